"""Quantization: the seed's portable kernels, QAT and GPTQ, as a public import path.

    from mudpuppy.quantization import quantize_per_tensor, dequantize, qgemm, fbgemm, flash_attention

The torch code lives under backends/torch/quantization/ (kernels.py, quantized_linear.py, qat/, gptq/),
where DESIGN.md puts every runtime import; this package re-exports it. `fbgemm`, `flash_attention`
and `FlashMHA` are the seed's names, kept only as aliases of `qgemm_bias_act`, `sdpa_attention` and
`SdpaSelfAttention` (`mudpuppy.quantization.kernels` says why).
Names resolve on first use, so importing this package imports no torch until a kernel is needed.
The kernels and their numerics: docs/qat.md; quantization-aware training: `mudpuppy.quantization.qat`;
GPTQ: `mudpuppy.quantization.gptq` and `.gptq_format`. The recipes are training/qat.py and
training/gptq.py, through the backend protocol's `plan_qat` and `plan_gptq`.
"""

from __future__ import annotations

import importlib

_KERNELS = (
    "quantize_per_tensor", "quantize_per_channel", "quantize_per_group", "quantize_per_token", "dequantize",
    "qgemm", "qgemm_bias_act", "quantized_layernorm", "sdpa_attention", "SdpaSelfAttention", "Quantized",
    "QuantizedLinear", "fbgemm", "flash_attention", "FlashMHA",
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
