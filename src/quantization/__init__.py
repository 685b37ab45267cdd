"""Quantization: the seed's portable kernels, QAT and GPTQ.

    from mudpuppy.quantization import quantize_per_tensor, dequantize, qgemm, fbgemm, flash_attention

Names resolve on first use, so importing this package costs nothing until a kernel is
needed (the kernels import torch). The kernels and their numerics: `kernels.py` and
docs/qat.md; quantization-aware training: `qat.py`; GPTQ: `gptq.py`.
"""

from __future__ import annotations

import importlib

_KERNELS = (
    "quantize_per_tensor", "quantize_per_channel", "quantize_per_group", "quantize_per_token", "dequantize",
    "qgemm", "fbgemm", "quantized_layernorm", "flash_attention", "FlashMHA", "Quantized", "QuantizedLinear",
    "int_mm_available", "pack_int4", "unpack_int4", "KernelInputError",
)
_QAT = ("QatSpec", "prepare_qat", "set_fake_quant", "convert_qat", "save_quantized", "load_quantized",
        "is_qat_checkpoint")

__all__ = [*_KERNELS, *_QAT]


def __getattr__(name: str):
    if name in _KERNELS:
        return getattr(importlib.import_module(".kernels", __name__), name)
    if name in _QAT:
        return getattr(importlib.import_module(".qat", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
