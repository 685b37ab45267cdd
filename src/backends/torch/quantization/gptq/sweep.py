"""GPTQ (Frantar et al., 2022, arXiv:2210.17323) for one weight matrix, in plain torch: no CUDA-only
call, so the same code runs on the CPU, ROCm and CUDA. The walk over a model's layers that feeds it
is layers.py; the files it writes, files.py.

Per linear layer, with H = 2 X^T X from the layer's calibration inputs X:

    damp:        H += damp_percent * mean(diag H) * I; when the Cholesky factorisation fails, raise
                 damp_percent by damp_auto_increment and retry (up to 1); a layer that still fails is
                 rounded to nearest instead, and the report says so
    act-order:   (desc_act) columns visited in order of decreasing diag H; g_idx maps them back
    the sweep:   U = chol(H^-1)^T (upper); for each column j, in blocks of 128:
                     q_j = quantize(w_j) on its group's grid (found when the sweep enters the group,
                           from the weights as updated so far)
                     e_j = (w_j - q_j) / U_jj;  w_k -= e_j U_jk for every later column k

Grids: asymmetric ``q = clamp(round(w / s) + z, 0, 2^b - 1)`` over [min(w, 0), max(w, 0)], or
symmetric with z = 2^(b-1) and s = 2 max|w| / (2^b - 1), as AutoGPTQ. Scales are rounded to fp16
before use, so the codes are exact for the stored scales. A zero point of 0 (an asymmetric group
with no negative weight) is moved to 1 with the scale widened to match (see format.py: v1
readers disagree about zero 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .format import PackedLinear, pack_linear

BLOCK = 128                   # columns per lazy-update block of the sweep


# --------------------------------------------------------------------------- one weight matrix


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 4
    group_size: int = 128             # -1: one group per row
    sym: bool = True
    desc_act: bool = False
    damp_percent: float = 0.01
    damp_auto_increment: float = 0.0025

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    def group_of(self, columns: int) -> int:
        return columns if self.group_size <= 0 else min(self.group_size, columns)

    @classmethod
    def from_config(cls, gptq_cfg) -> QuantSpec:
        return cls(gptq_cfg.bits, gptq_cfg.group_size, gptq_cfg.sym, gptq_cfg.desc_act, gptq_cfg.damp_percent,
                   gptq_cfg.damp_auto_increment)


@dataclass
class QuantizedWeight:
    """A quantized [out, in] weight: integer codes, per-group scales and zero points, g_idx."""

    codes: torch.Tensor       # int32 [out, in], in the original column order
    scales: torch.Tensor      # fp32 [groups, out], values exactly representable in fp16
    zeros: torch.Tensor       # int32 [groups, out], in [1, maxq]
    g_idx: torch.Tensor       # int32 [in]

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx.long()
        return (self.scales[g] * (self.codes.t() - self.zeros[g]).float()).t()

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        return QuantizedWeight(self.codes[start:stop], self.scales[:, start:stop], self.zeros[:, start:stop],
                               self.g_idx)

    def pack(self, bits: int, bias: torch.Tensor | None = None) -> PackedLinear:
        return pack_linear(self.codes, self.scales, self.zeros, self.g_idx, bits, bias)


def find_params(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point per row of `x` [rows, columns of one group]; the scale already fp16-rounded."""
    maxq = spec.maxq
    xmin = x.min(dim=1).values.clamp(max=0)
    xmax = x.max(dim=1).values.clamp(min=0)
    if spec.sym:
        amax = torch.maximum(-xmin, xmax)
        amax = torch.where(amax == 0, torch.ones_like(amax), amax)
        scale = fp16_scale(2 * amax / maxq)
        return scale, torch.full_like(scale, float((maxq + 1) // 2))
    both_zero = (xmin == 0) & (xmax == 0)
    xmin = torch.where(both_zero, -torch.ones_like(xmin), xmin)
    xmax = torch.where(both_zero, torch.ones_like(xmax), xmax)
    scale = fp16_scale((xmax - xmin) / maxq)
    zero = torch.round(-xmin / scale).clamp(0, maxq)
    # Zero point 0 cannot be stored the same way for every v1 reader: widen the grid by one step instead.
    low = zero < 1
    if bool(low.any()):
        scale = torch.where(low, fp16_scale(xmax / (maxq - 1)), scale)
        zero = torch.where(low, torch.ones_like(zero), zero)
    return scale, zero


def fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """The scale as the checkpoint will store it (fp16), never 0."""
    return scale.to(torch.float16).float().clamp(min=2.0 ** -24)


def quantize_column(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def round_to_nearest(weight: torch.Tensor, spec: QuantSpec) -> QuantizedWeight:
    """Round-to-nearest on the same grids (the baseline, and the fallback when the Cholesky fails)."""
    w = weight.detach().float()
    out_features, columns = w.shape
    group = spec.group_of(columns)
    n_groups = math.ceil(columns / group)
    scales = torch.empty(n_groups, out_features, device=w.device)
    zeros = torch.empty(n_groups, out_features, device=w.device)
    codes = torch.empty_like(w)
    for g in range(n_groups):
        cols = slice(g * group, min((g + 1) * group, columns))
        scale, zero = find_params(w[:, cols], spec)
        scales[g], zeros[g] = scale, zero
        codes[:, cols] = quantize_column(w[:, cols], scale[:, None], zero[:, None], spec.maxq)
    g_idx = torch.arange(columns, device=w.device) // group
    return QuantizedWeight(codes.to(torch.int32), scales, zeros.to(torch.int32), g_idx.to(torch.int32))


@dataclass
class Factor:
    """The upper Cholesky factor of the damped inverse Hessian, or why there is none."""

    upper: torch.Tensor | None
    damp_percent: float           # the damping that worked (or the last one tried)
    attempts: int


def inverse_hessian_factor(hessian: torch.Tensor, damp_percent: float, increment: float) -> Factor:
    """chol((H + damp * mean(diag H) * I)^-1), upper; the damping raised by `increment` after each failure."""
    n = hessian.shape[0]
    diag = torch.arange(n, device=hessian.device)
    mean = hessian.diagonal().mean()
    damp, attempts = damp_percent, 0
    finite = bool(torch.isfinite(hessian).all())
    while finite:
        attempts += 1
        damped = hessian.clone()
        damped[diag, diag] += damp * mean
        lower, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0 and bool(torch.isfinite(lower).all()):
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
            if int(info) == 0 and bool(torch.isfinite(upper).all()):
                return Factor(upper, damp, attempts)
        if increment <= 0 or damp + increment >= 1:
            break
        damp = round(damp + increment, 10)
    return Factor(None, damp, attempts)


@dataclass
class SweepResult:
    weight: QuantizedWeight
    damp_percent: float
    attempts: int
    fallback: bool                # rounded to nearest: no damping made the Hessian factorisable


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, spec: QuantSpec) -> SweepResult:
    """GPTQ for one [out, in] weight given H [in, in] (both on the device doing the work)."""
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    out_features, columns = w.shape
    dead = h.diagonal() == 0                   # inputs never active: any value works, use 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = None
    if spec.desc_act:
        perm = torch.argsort(h.diagonal(), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    factor = inverse_hessian_factor(h, spec.damp_percent, spec.damp_auto_increment)
    if factor.upper is None:
        return SweepResult(round_to_nearest(weight, spec), factor.damp_percent, factor.attempts, True)
    u = factor.upper
    group = spec.group_of(columns)
    n_groups = math.ceil(columns / group)
    block = group * math.ceil(BLOCK / group) if group < columns else columns   # groups never straddle blocks
    scales = torch.empty(n_groups, out_features, device=w.device)
    zeros = torch.empty(n_groups, out_features, device=w.device)
    codes = torch.empty_like(w)
    for i1 in range(0, columns, block):
        i2 = min(i1 + block, columns)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = col // group
            if col % group == 0:               # entering a group: its grid from the weights as updated so far
                scales[g], zeros[g] = find_params(w1[:, i:i + group], spec)
            scale, zero = scales[g], zeros[g]
            q = quantize_column(w1[:, i], scale, zero, spec.maxq)
            codes[:, col] = q
            err = (w1[:, i] - scale * (q - zero)) / u1[i, i]
            w1[:, i:] -= err[:, None] * u1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    position = torch.arange(columns, device=w.device)
    if perm is not None:
        inverse = torch.argsort(perm)
        codes = codes[:, inverse]
        position = inverse                     # where each original column sat in the sweep
    g_idx = (position // group).to(torch.int32)
    result = QuantizedWeight(codes.to(torch.int32), scales, zeros.to(torch.int32), g_idx)
    return SweepResult(result, factor.damp_percent, factor.attempts, False)


def output_error(weight: torch.Tensor, dequantized: torch.Tensor, hessian: torch.Tensor) -> float:
    """||(W - Q) X^T||^2 / ||W X^T||^2 over the calibration inputs, from H = X^T X (relative output error)."""
    w = weight.detach().float()
    d = w - dequantized
    num = float(((d @ hessian) * d).sum())
    den = float(((w @ hessian) * w).sum())
    return num / den if den > 0 else 0.0
