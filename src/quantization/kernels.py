"""`mudpuppy.quantization.kernels`: the seed's quantization kernels and QAT's linear layer, re-exported
from where the torch code lives (backends/torch/quantization/kernels.py, quantized_linear.py, and
backends/torch/model/sdpa_attention.py).

Three names are aliases kept only because the seed's callers use them, and say less than they seem:

    fbgemm           = qgemm_bias_act      qgemm, then bias and activation, in plain torch (not Meta's FBGEMM)
    flash_attention  = sdpa_attention      torch's scaled_dot_product_attention in the seed's layout
    FlashMHA         = SdpaSelfAttention   self-attention on it (nothing in mudpuppy uses either)
"""

from __future__ import annotations

from ..backends.torch.model.sdpa_attention import SdpaSelfAttention, sdpa_attention
from ..backends.torch.quantization.kernels import (
    ACTIVATIONS, EXACT_K_SLICE, KernelInputError, Quantized, dequantize, int_mm_available, qgemm, qgemm_bias_act,
    qrange, quantize_per_channel, quantize_per_group, quantize_per_tensor, quantize_per_token, quantized_layernorm,
)
from ..backends.torch.quantization.quantized_linear import QuantizedLinear, count_bytes, pack_int4, unpack_int4

# The seed's names: {alias: the name of what it is}.
SEED_ALIASES = {"fbgemm": "qgemm_bias_act", "flash_attention": "sdpa_attention", "FlashMHA": "SdpaSelfAttention"}
fbgemm = qgemm_bias_act
flash_attention = sdpa_attention
FlashMHA = SdpaSelfAttention

__all__ = [
    "ACTIVATIONS", "EXACT_K_SLICE", "FlashMHA", "KernelInputError", "Quantized", "QuantizedLinear",
    "SdpaSelfAttention", "count_bytes", "dequantize", "fbgemm", "flash_attention", "int_mm_available", "pack_int4",
    "qgemm", "qgemm_bias_act", "qrange", "quantize_per_channel", "quantize_per_group", "quantize_per_tensor",
    "quantize_per_token", "quantized_layernorm", "sdpa_attention", "unpack_int4",
]
