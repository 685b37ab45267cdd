"""Attention masks that keep packed examples apart.

A packed row holds several examples end to end. Restarting position ids at
each example is not enough: transformers (5.x, sdpa and eager) still lets a
token attend to every earlier token of the row, measured at ~0.5 logit error.
An explicit 4D block-diagonal causal mask isolates them exactly: token q may
attend to token k only when both belong to the same segment and k <= q.
Padding is segment 0 and attends only to earlier padding, so no attention
row is empty (an all-blocked row would turn into NaNs in the softmax).
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...errors import MudpuppyError

# Implementations that take a 4D mask as given. flash-attention takes none,
# and flex-attention wants a BlockMask: both are refused rather than run unmasked.
MASKABLE = ("sdpa", "eager")


def packed_attention_mask(segment_ids: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, T, T] mask: bool (True = attend) for sdpa, additive float (0 or dtype-min) for eager."""
    if attn_implementation not in MASKABLE:
        raise MudpuppyError(
            f"data.packing needs an attention implementation that accepts a 4D mask ({', '.join(MASKABLE)}); "
            f"this model uses {attn_implementation!r}. Turn packing off, or load the model with sdpa")
    width = segment_ids.shape[-1]
    causal = torch.ones(width, width, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal
    allowed = allowed[:, None, :, :]
    if attn_implementation == "sdpa":
        return allowed
    blocked = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=segment_ids.device)
    return blocked.masked_fill(allowed, 0.0)


# ---------------------------------------------------------------- which SDPA kernel

# Short rows attend through SDPA's math kernel on a CPU: for the quickstart's batches (8 x ~50 tokens,
# SmolLM2's 9 heads) a forward and backward of the fused (flash) CPU kernel took 5.3 ms per layer, the
# math kernel 1.8 ms (bf16, AMX Xeon, 2 threads; 64 tokens 5.5 vs 2.8 ms, 128: 11.7 vs 8.4, 256: 16.8
# vs 29.0). The math kernel keeps the [batch, heads, T, T] probabilities for the backward, so it is
# taken only while they stay small (the element budget below: 4 MB a layer in fp32).
MATH_ATTENTION_MAX_WIDTH = 128
MATH_ATTENTION_MAX_SCORES = 1 << 20


def attention_kernels(device: torch.device, batch: int, width: int, heads: int):
    """The SDPA kernels for a micro-batch of `batch` rows of `width` tokens: a context to hold
    around its forward *and* backward (checkpointing recomputes the forward inside the backward,
    and must choose the kernel the forward chose). Both kernels give the same values to the
    rounding of the output (checked in tests/backends/test_torch_speed_paths.py)."""
    scores = batch * heads * width * width
    if device.type != "cpu" or width > MATH_ATTENTION_MAX_WIDTH or scores > MATH_ATTENTION_MAX_SCORES:
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.MATH])
