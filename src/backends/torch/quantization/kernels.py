"""The seed's quantization kernels, in plain torch: the same code on CPU, CUDA and ROCm.

    quantize_per_tensor / quantize_per_channel / quantize_per_group / quantize_per_token
    dequantize                      (codes - zero_point) * scale, per tensor, channel, group or token
    qgemm                           int8 x int8 matmul: torch._int_mm where it helps, exact float elsewhere
    qgemm_bias_act                  qgemm, then bias and activation on the same output buffer
    quantized_layernorm             dequantize, layer norm, quantize again

The linear layer QAT converts to, holding int8 or int4 codes and group scales, is in
quantized_linear.py. The seed's names `fbgemm` (this is not Meta's FBGEMM), `flash_attention` and
`FlashMHA` (model/sdpa_attention.py) are aliases in mudpuppy.quantization.kernels.

The grid (one convention everywhere, torchao's, so QAT's fake quantization and the
converted model agree bit for bit):

    signed codes qmin = -2^(bits-1) .. qmax = 2^(bits-1) - 1, stored in int8 at any width
    symmetric    scale = max|x| / ((qmax - qmin) / 2),              zero_point = 0
    asymmetric   scale = (max(x, 0) - min(x, 0)) / (qmax - qmin),   zero_point = qmin - round(min(x, 0) / scale)
    code         q = clamp(round(x * (1 / scale)) + zero_point, qmin, qmax)     (round half to even)
    value        (q - zero_point) * scale

Scales are computed in the input's dtype, floored at its smallest normal number (an
all-zero group gets codes 0), and returned as float32; zero points as int32.

Integer matmuls are exact in both paths `qgemm` can take: `torch._int_mm` accumulates
in int32, and the fallback multiplies the codes as float32 in slices of at most 1024
along K, where every partial sum of int8 products (at most 1024 * 128 * 128 = 2^24)
is an integer float32 holds exactly, then adds the slices in int32. Both paths give
the same int32 matrix, and the same float output after the scales.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ....errors import MudpuppyError

EXACT_K_SLICE = 1024          # int8 products summed exactly in float32: 1024 * 2^14 = 2^24
ACTIVATIONS = ("relu", "gelu", "silu", "tanh", "sigmoid")


class KernelInputError(MudpuppyError, ValueError):
    """Bad arguments to a kernel: a ValueError for Python callers, a clean exit 2 under the CLI."""


class Quantized(NamedTuple):
    """Codes and what turns them back into numbers; unpacks as ``q, scale, zero_point``."""

    q: torch.Tensor               # int8 codes
    scale: torch.Tensor           # float32, broadcastable to q (or one per group along q's last axis)
    zero_point: torch.Tensor      # int32, shaped as scale (zeros when symmetric)


# --------------------------------------------------------------------------- quantize / dequantize


def qrange(bits: int) -> tuple[int, int]:
    """(qmin, qmax) of signed `bits`-bit codes."""
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise KernelInputError(f"bits: {bits!r} is not supported; codes are signed integers of 2 to 8 bits")
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def _check_float(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        kind = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise KernelInputError(f"{what}: expected a floating-point tensor, got {kind}")


def _qparams(lo: torch.Tensor, hi: torch.Tensor, bits: int, symmetric: bool, dtype: torch.dtype):
    """Scale (float32) and zero point (int32) from a block's min and max, both in the input's dtype."""
    qmin, qmax = qrange(bits)
    eps = torch.finfo(dtype).smallest_normal
    lo, hi = torch.clamp(lo, max=0), torch.clamp(hi, min=0)
    if symmetric:
        scale = torch.clamp(torch.maximum(-lo, hi) / ((qmax - qmin) / 2), min=eps)
        zero = torch.zeros_like(scale, dtype=torch.int32)
    else:
        scale = torch.clamp((hi - lo) / float(qmax - qmin), min=eps)
        zero = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax).to(torch.int32)
    return scale.to(torch.float32), zero


def _codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    qmin, qmax = qrange(bits)
    return torch.clamp(torch.round(x * (1.0 / scale)) + zero, qmin, qmax).to(torch.int8)


def quantize_per_tensor(tensor: torch.Tensor, bits: int = 8, symmetric: bool = True) -> Quantized:
    """One scale (and zero point) for the whole tensor; 0-d scale and zero point."""
    _check_float(tensor, "quantize_per_tensor")
    if tensor.numel() == 0:
        raise KernelInputError("quantize_per_tensor: the tensor is empty")
    scale, zero = _qparams(tensor.amin(), tensor.amax(), bits, symmetric, tensor.dtype)
    return Quantized(_codes(tensor, scale, zero, bits), scale, zero)


def quantize_per_channel(tensor: torch.Tensor, bits: int = 8, dim: int = 0, symmetric: bool = True) -> Quantized:
    """One scale per index along `dim` (dim 0 of a [out, in] weight: one per output row).

    Scale and zero point keep every dimension, size 1 except `dim`, so they broadcast against the codes."""
    _check_float(tensor, "quantize_per_channel")
    if tensor.dim() == 0 or tensor.numel() == 0:
        raise KernelInputError("quantize_per_channel: needs a non-empty tensor with at least one dimension")
    if not -tensor.dim() <= dim < tensor.dim():
        raise KernelInputError(f"quantize_per_channel: dim {dim} is out of range for a {tensor.dim()}-d tensor")
    dim = dim % tensor.dim()
    others = [d for d in range(tensor.dim()) if d != dim]
    lo = tensor.amin(dim=others, keepdim=True) if others else tensor
    hi = tensor.amax(dim=others, keepdim=True) if others else tensor
    scale, zero = _qparams(lo, hi, bits, symmetric, tensor.dtype)
    return Quantized(_codes(tensor, scale, zero, bits), scale, zero)


def quantize_per_group(tensor: torch.Tensor, bits: int = 4, group_size: int = 32, symmetric: bool = True) -> Quantized:
    """One scale per run of `group_size` values along the last axis (-1: the whole last axis).

    For a [out, in] weight: scales [out, in / group_size], torchao's per-group layout."""
    _check_float(tensor, "quantize_per_group")
    if tensor.dim() == 0 or tensor.numel() == 0:
        raise KernelInputError("quantize_per_group: needs a non-empty tensor with at least one dimension")
    width = tensor.shape[-1]
    group = width if group_size == -1 else group_size
    if not isinstance(group, int) or group <= 0 or width % group:
        raise KernelInputError(f"quantize_per_group: group_size {group_size} does not divide the last dimension "
                               f"({width}); choose a divisor of it, or -1 for one group per row")
    blocks = tensor.reshape(*tensor.shape[:-1], width // group, group)
    scale, zero = _qparams(blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True), bits, symmetric,
                           tensor.dtype)
    q = _codes(blocks, scale, zero, bits).reshape(tensor.shape)
    return Quantized(q, scale.squeeze(-1), zero.squeeze(-1))


def quantize_per_token(x: torch.Tensor, bits: int = 8, symmetric: bool = False) -> Quantized:
    """One scale per row of the last axis (per token of [batch, time, features] activations):
    torchao's dynamic per-token activation quantization (asymmetric by default). Scale [..., 1]."""
    _check_float(x, "quantize_per_token")
    if x.dim() == 0 or x.numel() == 0:
        raise KernelInputError("quantize_per_token: needs a non-empty tensor with at least one dimension")
    scale, zero = _qparams(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), bits, symmetric, x.dtype)
    return Quantized(_codes(x, scale, zero, bits), scale, zero)


def dequantize(qtensor: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | float | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - zero_point) * scale`` in `dtype` (computed in float32).

    `scale` broadcasts against the codes (per tensor, channel or token), or holds one value per
    group along their last axis: a scale whose last dimension G divides the codes' last dimension K
    (and is not 1) stands for groups of K / G consecutive values, as `quantize_per_group` returns."""
    if not isinstance(qtensor, torch.Tensor) or qtensor.is_floating_point():
        raise KernelInputError("dequantize: expected integer codes (int8), got "
                               f"{qtensor.dtype if isinstance(qtensor, torch.Tensor) else type(qtensor).__name__}")
    scale = torch.as_tensor(scale, dtype=torch.float32, device=qtensor.device)
    zero = None if zero_point is None else torch.as_tensor(zero_point, device=qtensor.device)
    scale, zero = _expand_groups(qtensor, scale, zero)
    values = qtensor.to(torch.float32)
    if zero is not None:
        values = values - zero.to(torch.float32)
    return (values * scale).to(dtype)


def _expand_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None):
    """Per-group scales (and zero points) repeated to one per code along the last axis."""
    if scale.dim() == 0 or q.dim() == 0 or scale.shape[-1] in (1, q.shape[-1]):
        return scale, zero
    width, groups = q.shape[-1], scale.shape[-1]
    if width % groups or scale.dim() != q.dim():
        raise KernelInputError(f"dequantize: scale of shape {tuple(scale.shape)} neither broadcasts against codes of "
                               f"shape {tuple(q.shape)} nor holds one value per group of their last axis")
    size = width // groups
    scale = scale.repeat_interleave(size, dim=-1)
    if zero is not None and zero.dim() and zero.shape[-1] == groups:
        zero = zero.repeat_interleave(size, dim=-1)
    return scale, zero


# --------------------------------------------------------------------------- int8 matmul


_PROBED: dict[str, bool] = {}


def _int_mm_works(device: torch.device) -> bool:
    """Whether torch._int_mm runs on this kind of device, found by running it once (cached)."""
    key = device.type
    if key not in _PROBED:
        try:
            a = torch.ones(32, 32, dtype=torch.int8, device=device)
            _PROBED[key] = bool((torch._int_mm(a, a) == 32).all())
        except (RuntimeError, NotImplementedError, AttributeError):
            _PROBED[key] = False
    return _PROBED[key]


def int_mm_available(a_q: torch.Tensor, b_q: torch.Tensor) -> bool:
    """Whether `qgemm` runs these operands ([M, K] x [K, N], int8) through ``torch._int_mm`` by default.

    On CUDA and ROCm when the shapes meet cuBLASLt/hipBLASLt's int8 rules (M > 16, K and N
    multiples of 8); never by default on a CPU, where torch 2.13's _int_mm is exact but was
    measured 10x slower than the exact float32 path (docs/qat.md). Pass ``use_int_mm=True``
    to qgemm to force it wherever the device runs it."""
    if a_q.device.type not in ("cuda", "hip"):
        return False
    m, k = a_q.shape[0], a_q.shape[1]
    n = b_q.shape[1]
    return m > 16 and k % 8 == 0 and n % 8 == 0 and k > 0 and n > 0 and _int_mm_works(a_q.device)


def _int_matmul(a: torch.Tensor, b: torch.Tensor, use_int_mm: bool) -> torch.Tensor:
    """Exact int32 product of int8 [M, K] and [K, N]."""
    if use_int_mm:
        if a.device.type != "cpu":             # cuBLASLt reads row-major operands only
            a, b = a.contiguous(), b.contiguous()
        return torch._int_mm(a, b)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.int32, device=a.device)
    with torch.autocast(a.device.type, enabled=False):     # bf16 autocast would round the integers
        for start in range(0, a.shape[1], EXACT_K_SLICE):
            part = a[:, start:start + EXACT_K_SLICE].float() @ b[start:start + EXACT_K_SLICE].float()
            out += part.to(torch.int32)
    return out


def qgemm(a_q: torch.Tensor, a_scale, b_q: torch.Tensor, b_scale, a_zero_point=None, b_zero_point=None, *,
          out_dtype: torch.dtype = torch.float32, use_int_mm: bool | None = None) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b)`` computed on the integer codes.

    a_q      int8 [..., K]; a_scale / a_zero_point: a number, 0-d, or per row [..., 1]
    b_q      int8 [K, N];   b_scale / b_zero_point: a number, 0-d, per column [N] or [1, N],
             or per group of rows [G, N] (G dividing K: rows g*K/G .. (g+1)*K/G share one scale)

    The integer part, sum over k of (a - za)(b - zb), is exact (int32, see the module docstring);
    each group's is then scaled by a_scale * b_scale in float32 and the groups summed.
    `use_int_mm`: None picks `int_mm_available`; True forces torch._int_mm; False the float path."""
    a2, b_q = _check_qgemm(a_q, b_q)
    k, n = b_q.shape
    lead = a_q.shape[:-1]
    a_scale = _per_row(a_scale, lead, a2, "a_scale")
    za = None if a_zero_point is None else _per_row(a_zero_point, lead, a2, "a_zero_point").to(torch.int32)
    b_scale = _per_column(b_scale, k, n, b_q, "b_scale")
    zb = None if b_zero_point is None else _per_column(b_zero_point, k, n, b_q, "b_zero_point").to(torch.int32)
    groups = b_scale.shape[0]
    if zb is not None and zb.shape[0] not in (1, groups):
        raise KernelInputError(f"qgemm: b_zero_point has {zb.shape[0]} groups, b_scale {groups}")
    size = k // groups
    if use_int_mm is None:
        use_int_mm = int_mm_available(a2, b_q)
    elif use_int_mm and not _int_mm_works(a2.device):
        raise KernelInputError(f"qgemm: use_int_mm=True, but torch._int_mm does not run on {a2.device.type} here")
    out = torch.zeros(a2.shape[0], n, dtype=torch.float32, device=a2.device)
    for g in range(groups):
        rows = slice(g * size, (g + 1) * size)
        a_g, b_g = a2[:, rows], b_q[rows]
        acc = _int_matmul(a_g, b_g, use_int_mm)
        # (a - za)(b - zb) = ab - za * colsum(b) - zb * rowsum(a) + size * za * zb, all in int32
        if za is not None:
            acc -= za * b_g.sum(0, dtype=torch.int32)
        if zb is not None:
            zb_g = zb[min(g, zb.shape[0] - 1)]
            acc -= a_g.sum(1, keepdim=True, dtype=torch.int32) * zb_g
            if za is not None:
                acc += size * za * zb_g
        out += acc.to(torch.float32) * (a_scale * b_scale[g])
    return out.reshape(*lead, n).to(out_dtype)


def _check_qgemm(a_q, b_q):
    for name, t in (("a_q", a_q), ("b_q", b_q)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int8:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise KernelInputError(f"qgemm: {name} must be int8 codes, got {got}")
    if b_q.dim() != 2 or a_q.dim() < 1:
        raise KernelInputError(f"qgemm: b_q must be [K, N] and a_q [..., K]; got {tuple(a_q.shape)} and "
                               f"{tuple(b_q.shape)}")
    if a_q.shape[-1] != b_q.shape[0]:
        raise KernelInputError(f"qgemm: inner dimensions differ: a_q is {tuple(a_q.shape)}, b_q {tuple(b_q.shape)}")
    if a_q.device != b_q.device:
        raise KernelInputError(f"qgemm: a_q is on {a_q.device}, b_q on {b_q.device}")
    return a_q.reshape(-1, a_q.shape[-1]), b_q


def _per_row(value, lead, a2, name) -> torch.Tensor:
    """A per-tensor or per-row quantity as a column [M, 1] (or a 0-d tensor)."""
    t = torch.as_tensor(value, device=a2.device)
    t = t.to(torch.float32) if name.endswith("scale") else t
    if t.numel() == 1:
        return t.reshape(())
    if tuple(t.shape) != (*lead, 1) and tuple(t.shape) != tuple(lead):
        raise KernelInputError(f"qgemm: {name} of shape {tuple(t.shape)} is neither one number nor one per row of "
                               f"a ({(*lead, 1)})")
    return t.reshape(-1, 1)


def _per_column(value, k, n, b_q, name) -> torch.Tensor:
    """A per-tensor, per-column or per-group quantity of b as [G, N] (G = 1 unless grouped)."""
    t = torch.as_tensor(value, device=b_q.device)
    t = t.to(torch.float32) if name.endswith("scale") else t
    if t.numel() == 1:
        return t.reshape(1, 1).expand(1, n)
    if t.dim() == 1 and t.shape[0] == n:
        return t.reshape(1, n)
    if t.dim() == 2 and t.shape[1] == n and k % t.shape[0] == 0:
        return t
    raise KernelInputError(f"qgemm: {name} of shape {tuple(t.shape)} is not one number, one per column of b ({n}), "
                           f"or [groups, {n}] with groups dividing K ({k})")


def qgemm_bias_act(a_q: torch.Tensor, a_scale, b_q: torch.Tensor, b_scale, bias: torch.Tensor | None = None,
                   activation: str | None = None, *, a_zero_point=None, b_zero_point=None,
                   out_dtype: torch.dtype = torch.float32, use_int_mm: bool | None = None) -> torch.Tensor:
    """``activation(qgemm(...) + bias)``: the seed's "fused" GEMM + bias + activation.

    What "fused" means here: one call, and the bias and activation are applied in place on
    qgemm's float32 output (gelu, which torch has no in-place form of, excepted), so no
    intermediate tensor is allocated between the three steps. It is not a single device kernel: torch runs the matmul, the add and the activation as
    separate operations (torch.compile can fuse the last two). `activation`: None or one of
    relu, gelu, silu, tanh, sigmoid."""
    if activation is not None and activation not in ACTIVATIONS:
        raise KernelInputError(f"qgemm_bias_act: activation {activation!r} is not one of {', '.join(ACTIVATIONS)} (or None)")
    out = qgemm(a_q, a_scale, b_q, b_scale, a_zero_point, b_zero_point, use_int_mm=use_int_mm)
    if bias is not None:
        if bias.shape[-1] != out.shape[-1] or bias.dim() > 1:
            raise KernelInputError(f"qgemm_bias_act: bias of shape {tuple(bias.shape)} does not match the output's last "
                                   f"dimension ({out.shape[-1]})")
        out.add_(bias.to(torch.float32))
    if activation == "relu":
        out.relu_()
    elif activation == "gelu":
        out.copy_(F.gelu(out))
    elif activation == "silu":
        F.silu(out, inplace=True)
    elif activation == "tanh":
        out.tanh_()
    elif activation == "sigmoid":
        out.sigmoid_()
    return out.to(out_dtype)


# --------------------------------------------------------------------------- layer norm


def quantized_layernorm(x_q: torch.Tensor, x_scale, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        eps: float = 1e-5, *, x_zero_point=None, bits: int = 8, per_row: bool = False) -> Quantized:
    """Layer norm of quantized activations, quantized again (symmetric).

    Dequantizes (any of dequantize's scale layouts), runs ``F.layer_norm`` over the last
    dimension in float32 with `weight` and `bias`, then quantizes the result to `bits`: one
    scale for the tensor, or with `per_row` one per row (a [..., 1] scale that `qgemm` takes
    as its a_scale). Naive and portable: the statistics are computed in float, not on the codes."""
    if weight.dim() != 1 or weight.shape[0] != x_q.shape[-1]:
        raise KernelInputError(f"quantized_layernorm: weight of shape {tuple(weight.shape)} does not match the "
                               f"last dimension of x_q ({x_q.shape[-1]})")
    x = dequantize(x_q, x_scale, x_zero_point)
    y = F.layer_norm(x, (x.shape[-1],), weight.to(torch.float32),
                     None if bias is None else bias.to(torch.float32), eps)
    if per_row:
        return quantize_per_token(y, bits=bits, symmetric=True)
    return quantize_per_tensor(y, bits=bits)
