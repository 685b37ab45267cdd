"""Attention in the seed's [batch, seq, heads, head_dim] layout through torch's scaled_dot_product_attention.

`sdpa_attention` and the self-attention layer `SdpaSelfAttention` are plain SDPA calls, kept because the
seed offered them as `flash_attention` and `FlashMHA` (those names are aliases in
mudpuppy.quantization.kernels): SDPA picks the flash kernel where the device has one, and the math kernel
otherwise. mudpuppy's own models attend through transformers (attention.py), not through these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..quantization.kernels import KernelInputError


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, dropout_p: float = 0.0,
                   *, mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v through ``F.scaled_dot_product_attention``.

    Tensors are [batch, seq, heads, head_dim] (the seed's layout); k and v may have fewer heads
    than q, a divisor of them (grouped-query attention). `mask`: boolean (True = attend) or
    additive float, broadcastable to [batch, heads, q_seq, k_seq]. `scale` defaults to
    1/sqrt(head_dim). SDPA picks the fused (flash or memory-efficient) kernel the device has
    for these inputs, and the plain math kernel otherwise; the result is the same attention."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise KernelInputError(f"sdpa_attention: q, k and v must be [batch, seq, heads, head_dim]; got shapes "
                               f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise KernelInputError(f"sdpa_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do "
                               "not agree on batch, head_dim, or (k and v) shape")
    if q.shape[2] % k.shape[2]:
        raise KernelInputError(f"sdpa_attention: q's {q.shape[2]} heads are not a multiple of k's {k.shape[2]}")
    if not 0.0 <= dropout_p < 1.0:
        raise KernelInputError(f"sdpa_attention: dropout_p {dropout_p} is not in [0, 1)")
    if causal and mask is not None:
        raise KernelInputError("sdpa_attention: give causal=True or a mask, not both (fold causality into the mask)")
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, dropout_p=dropout_p,
        is_causal=causal, scale=scale, enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


class SdpaSelfAttention(nn.Module):
    """Multi-head self-attention on `sdpa_attention`, with nn.MultiheadAttention's projections.

    ``qkv`` maps x to queries, keys and values (in that order, as MultiheadAttention's
    in_proj), ``out_proj`` maps the heads back. Dropout on the attention weights applies in
    training mode only. ``forward(x, attention_mask=None, causal=False)``: x [batch, seq,
    embed_dim]; attention_mask a [batch, seq] padding mask (1 = real token) or any mask
    `sdpa_attention` takes."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise KernelInputError(f"SdpaSelfAttention: embed_dim {embed_dim} is not a positive multiple of num_heads "
                                   f"{num_heads}")
        if not 0.0 <= dropout < 1.0:
            raise KernelInputError(f"SdpaSelfAttention: dropout {dropout} is not in [0, 1)")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.dropout = dropout
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, causal: bool = False):
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.num_heads, self.head_dim).unbind(dim=2)
        mask = attention_mask
        if mask is not None and mask.dim() == 2:           # [batch, seq] padding: hide padded keys
            mask = mask.to(torch.bool)[:, None, None, :]
        if causal and mask is not None:
            allowed = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            mask = (mask & allowed) if mask.dtype == torch.bool else mask.masked_fill(~allowed, float("-inf"))
            causal = False
        out = sdpa_attention(q, k, v, causal=causal, dropout_p=self.dropout if self.training else 0.0, mask=mask)
        return self.out_proj(out.reshape(batch, seq, self.embed_dim))
