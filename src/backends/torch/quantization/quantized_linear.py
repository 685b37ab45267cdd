"""The linear layer of a converted QAT model: int8 or int4 codes and float32 group scales
(`QuantizedLinear`), the int4 storage it is written in (`pack_int4`), and what a model of them weighs.

It computes through the seed's kernels (kernels.py): its weights are dequantized on torchao's grid, the
one QAT's fake quantization trained against, or with int8 activations multiplied on the codes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import KernelInputError, dequantize, qgemm_bias_act, qrange, quantize_per_group, quantize_per_token


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit codes (int8, values -8..7, even last dimension) two to a byte: byte j of a row holds
    code 2j + 8 in its low nibble and code 2j+1 + 8 in its high nibble (uint8, half the last dimension)."""
    if q.dtype != torch.int8 or q.shape[-1] % 2:
        raise KernelInputError(f"pack_int4: needs int8 codes with an even last dimension, got {q.dtype} "
                               f"{tuple(q.shape)}")
    if q.numel() and (q.min() < -8 or q.max() > 7):
        raise KernelInputError("pack_int4: codes outside -8..7 do not fit in 4 bits")
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: int8 codes -8..7, twice the last dimension."""
    if packed.dtype != torch.uint8:
        raise KernelInputError(f"unpack_int4: needs uint8 bytes, got {packed.dtype}")
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with W held as int8 codes (of 4 or 8 bits) and float32 scales per group of inputs.

    Buffers: ``qweight`` int8 [out, in], ``scales`` float32 [out, in / group_size], and the
    float ``bias`` when there is one. Weights are symmetric (zero point 0).

    activations "none"   W is dequantized per call to the input's dtype (codes * scale, the
                         values QAT's fake quantization trained against) and applied with F.linear.
    activations "int8"   x is quantized per token (asymmetric int8, as torchao's QAT fakes it)
                         and the product runs on the codes through `qgemm_bias_act` (qgemm + bias).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, bits: int, group_size: int,
                 activations: str = "none", weight_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        qrange(bits)
        group = in_features if group_size == -1 else group_size
        if group <= 0 or in_features % group:
            raise KernelInputError(f"QuantizedLinear: group_size {group_size} does not divide in_features "
                                   f"{in_features}")
        if activations not in ("none", "int8"):
            raise KernelInputError(f"QuantizedLinear: activations must be 'none' or 'int8', not {activations!r}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.activations = bits, group_size, activations
        self.weight_dtype = weight_dtype
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(out_features, in_features // group, dtype=torch.float32,
                                                  device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, bits: int, group_size: int,
                    activations: str = "none") -> "QuantizedLinear":
        """Round-to-nearest of `weight` on the symmetric per-group grid (the one QAT fakes)."""
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, bias is not None, bits, group_size, activations, weight.dtype,
                    weight.device)
        q, scale, _ = quantize_per_group(weight.detach(), bits, group_size, symmetric=True)
        layer.qweight.copy_(q)
        layer.scales.copy_(scale)
        if bias is not None:
            layer.bias = bias.detach().clone()
        return layer

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """codes * scale in float32, rounded to `dtype` (default: the dtype of the weight it replaced)."""
        return dequantize(self.qweight, self.scales, dtype=dtype or self.weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == "none":
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.dequantized_weight(x.dtype), bias)
        xq, xs, xz = quantize_per_token(x, bits=8, symmetric=False)
        groups = self.scales.shape[1]
        out = qgemm_bias_act(xq, xs, self.qweight.t(), self.scales.t() if groups > 1 else self.scales[:, 0], self.bias,
                     a_zero_point=xz)
        autocast = torch.is_autocast_enabled(x.device.type)      # answer in the dtype F.linear would
        return out.to(torch.get_autocast_dtype(x.device.type) if autocast else x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, activations={self.activations}")


def count_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers, int4 codes counted at half a byte (as stored)."""
    total = 0
    seen = set()
    for module in model.modules():
        for name, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            size = t.numel() * t.element_size()
            if isinstance(module, QuantizedLinear) and name == "qweight" and module.bits <= 4:
                size = math.ceil(size / 2)
            total += size
    return total
