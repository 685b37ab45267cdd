"""`mudpuppy.quantization.kernels`: the seed's quantization kernels and QAT's linear layer, re-exported
from where the torch code lives (backends/torch/quantization/kernels.py, backends/torch/quantization/quantized_linear.py)."""

from __future__ import annotations

from ..backends.torch.quantization.kernels import (
    ACTIVATIONS, EXACT_K_SLICE, FlashMHA, KernelInputError, Quantized, dequantize, fbgemm, flash_attention,
    int_mm_available, qgemm, qrange, quantize_per_channel, quantize_per_group, quantize_per_tensor,
    quantize_per_token, quantized_layernorm,
)
from ..backends.torch.quantization.quantized_linear import QuantizedLinear, count_bytes, pack_int4, unpack_int4

__all__ = [
    "ACTIVATIONS", "EXACT_K_SLICE", "FlashMHA", "KernelInputError", "Quantized", "QuantizedLinear", "count_bytes",
    "dequantize", "fbgemm", "flash_attention", "int_mm_available", "pack_int4", "qgemm", "qrange",
    "quantize_per_channel", "quantize_per_group", "quantize_per_tensor", "quantize_per_token",
    "quantized_layernorm", "unpack_int4",
]
