"""`mudpuppy.quantization.gptq_format`: the GPTQ checkpoint layout (AutoGPTQ's v1), re-exported from where
the torch code lives (backends/torch/quantization/gptq/format.py)."""

from __future__ import annotations

from ..backends.torch.quantization.gptq.format import (
    FORMAT, PACK_WIDTH, SUPPORTED_BITS, GptqSettings, PackedLinear, check_packable, dequantize_packed, pack_last,
    pack_linear, quantization_config, read_quantization_config, unpack_codes, unpack_last, unpack_zeros,
)

__all__ = [
    "FORMAT", "PACK_WIDTH", "SUPPORTED_BITS", "GptqSettings", "PackedLinear", "check_packable", "dequantize_packed",
    "pack_last", "pack_linear", "quantization_config", "read_quantization_config", "unpack_codes", "unpack_last",
    "unpack_zeros",
]
