"""GPTQ (Frantar et al., 2022, arXiv:2210.17323) in plain torch: no CUDA-only call, so the same code
runs on the CPU, ROCm and CUDA.

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
with no negative weight) is moved to 1 with the scale widened to match (see gptq_format.py: v1
readers disagree about zero 0).

The model: `quantize_model` walks the decoder layers one at a time. The inputs of the first layer
are captured once for every calibration example (batched by length, right-padded: causal attention
keeps real tokens exact, and only real tokens enter a Hessian); each layer is brought to the device in fp32,
its linear layers quantized set by set (true-sequential: q/k/v, then o, then gate/up, then down,
each set found as "the linears that read the same tensor" and calibrated on the outputs of the sets
already quantized), then run on the inputs to give the next layer's, with its quantized weights:
what the next layer sees is what the saved model computes. Only one decoder layer, the
activations and one Hessian are on the device at a time; the rest of the model stays in host
memory at its storage dtype. Linears of a set share one Hessian, so they are quantized in one sweep
(the rows of W are independent given H).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import MudpuppyError
from .gptq_format import PackedLinear, check_packable, pack_linear

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


# --------------------------------------------------------------------------- the model, layer by layer


class _Stop(Exception):
    """Raised from a hook once it has what it came for: the rest of the forward pass is not needed."""


@dataclass
class SetReport:
    """One set of linears sharing an input (q/k/v, o, gate/up, down), in one decoder layer."""

    layer: int
    names: list[str]
    damp_percent: float
    attempts: int
    fallback: bool                # Cholesky failed at every damping: rounded to nearest
    error_gptq: float             # relative output error on the calibration inputs
    error_rtn: float              # the same for round-to-nearest, for comparison


@dataclass
class GptqReport:
    sets: list[SetReport] = field(default_factory=list)
    layers: int = 0
    linears: int = 0
    calibration_examples: int = 0
    calibration_tokens: int = 0
    seconds: float = 0.0

    @property
    def fallbacks(self) -> list[str]:
        return [f"layer {s.layer}: {', '.join(s.names)}" for s in self.sets if s.fallback]

    @property
    def raised_damping(self) -> list[str]:
        return [f"layer {s.layer}: {', '.join(s.names)} (damp_percent {s.damp_percent:g})"
                for s in self.sets if s.attempts > 1 and not s.fallback]

    def as_dict(self) -> dict:
        gptq = [s.error_gptq for s in self.sets]
        rtn = [s.error_rtn for s in self.sets]
        return {
            "layers": self.layers, "linears": self.linears, "calibration_examples": self.calibration_examples,
            "calibration_tokens": self.calibration_tokens, "seconds": round(self.seconds, 1),
            "mean_output_error_gptq": sum(gptq) / max(len(gptq), 1),
            "mean_output_error_rtn": sum(rtn) / max(len(rtn), 1),
            "damping_raised": self.raised_damping, "rtn_fallback": self.fallbacks,
            "sets": [asdict(s) for s in self.sets],
        }


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's repeated blocks: the longest ModuleList whose entries hold linear layers."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if (isinstance(module, nn.ModuleList) and len(module)
                and any(isinstance(m, nn.Linear) for m in module[0].modules())
                and (best is None or len(module) > len(best[1]))):
            best = (name, module)
    if best is None:
        raise MudpuppyError(f"{type(model).__name__}: no decoder layers (a ModuleList of blocks with linear layers) "
                            "found; GPTQ quantizes the linear layers of a transformer's blocks")
    return best


def select_linears(block: nn.Module, modules) -> list[str]:
    """Names (inside one block) of the plain linear layers to quantize: all of them, or those whose name is,
    or ends with, an entry of `modules`."""
    names = [name for name, m in block.named_modules() if type(m) is nn.Linear]
    if modules == "all-linear":
        return names
    return [n for n in names if any(n == e or n.endswith("." + e) for e in modules)]


def plan_linears(model: nn.Module, modules) -> tuple[str, nn.ModuleList, list[str]]:
    """The decoder layers and the linears of each to quantize; every problem (unknown module names,
    shapes the layout cannot pack) named at once."""
    prefix, layers = find_decoder_layers(model)
    chosen = select_linears(layers[0], modules)
    every = sorted({n.rsplit(".", 1)[-1] for n in select_linears(layers[0], "all-linear")})
    if modules != "all-linear":
        unknown = [e for e in modules if not any(n == e or n.endswith("." + e) for n in chosen)]
        if unknown:
            raise MudpuppyError(f"gptq.modules: {', '.join(unknown)} match no linear layer of the model's blocks "
                                f"(they hold: {', '.join(every)})")
    if not chosen:
        from ..backends.torch.frozen import FrozenLinear

        if any(isinstance(m, FrozenLinear) for m in layers[0].modules()):
            raise MudpuppyError("the model's linear layers are already quantized (a GPTQ or 4-bit model); "
                                "GPTQ starts from the full-precision model")
        raise MudpuppyError(f"gptq.modules: nothing to quantize (the blocks' linear layers: {', '.join(every)})")
    problems = [p for name in chosen
                if (p := check_packable(name, (m := layers[0].get_submodule(name)).in_features, m.out_features))]
    if problems:
        raise MudpuppyError("cannot store these layers in the GPTQ layout: " + "; ".join(problems)
                            + "; leave them out with gptq.modules")
    return prefix, layers, chosen


def _to_work(module: nn.Module, device, recurse: bool = True) -> dict[str, torch.dtype]:
    """Floating parameters and buffers to fp32 on `device`, in place (tied weights stay tied); returns
    their dtypes, for `_to_host`."""
    named = [*module.named_parameters(recurse=recurse), *module.named_buffers(recurse=recurse)]
    dtypes = {name: t.dtype for name, t in named if t.is_floating_point()}
    module._apply(lambda t: t.to(device=device, dtype=torch.float32) if t.is_floating_point() else t.to(device),
                  recurse=recurse)
    return dtypes


def _to_host(module: nn.Module, dtypes: dict[str, torch.dtype], recurse: bool = True) -> None:
    """Back to host memory, each tensor `_to_work` moved in its own dtype again (exact: it was upcast)."""
    module._apply(lambda t: t.to("cpu"), recurse=recurse)
    for name, dtype in dtypes.items():
        owner, _, leaf = name.rpartition(".")
        holder = module.get_submodule(owner) if owner else module
        if isinstance(holder._parameters.get(leaf), torch.Tensor):
            holder._parameters[leaf].data = holder._parameters[leaf].data.to(dtype)
        elif isinstance(holder._buffers.get(leaf), torch.Tensor):
            holder._buffers[leaf] = holder._buffers[leaf].to(dtype)


def _outside(model: nn.Module, prefix: str) -> list[nn.Module]:
    """Modules not inside the decoder layers (embeddings, rotary tables, final norm, head)."""
    return [m for name, m in model.named_modules()
            if not (name == prefix or name.startswith(prefix + "."))]


def _float32(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    if isinstance(value, tuple):
        return tuple(_float32(v) for v in value)
    return value


BATCH_TOKENS = 4096           # padded tokens per calibration batch


@dataclass
class Calibration:
    """The calibration examples as they enter the current decoder layer, a batch at a time: examples of
    similar length right-padded together. Under causal attention a real token never sees the padding
    after it, so its activations are exact; only real tokens' inputs enter a Hessian."""

    hidden: list[torch.Tensor]    # fp32 [batch, time, hidden] on the device
    kwargs: list[dict]            # what the model passes its layers for that batch (rotary tables, positions)
    real: list[torch.Tensor]      # bool [batch, time]: real tokens, not padding

    def __len__(self) -> int:
        return len(self.hidden)


def calibration_batches(examples: list[torch.Tensor], max_tokens: int = BATCH_TOKENS) -> list[list[int]]:
    """Example indices grouped by length, each group at most `max_tokens` once padded."""
    order = sorted(range(len(examples)), key=lambda i: examples[i].numel())
    batches: list[list[int]] = []
    for i in order:
        width = examples[i].numel()               # the longest so far: the order is ascending
        if batches and (len(batches[-1]) + 1) * width <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def capture_inputs(model: nn.Module, prefix: str, layers: nn.ModuleList, examples: list[torch.Tensor],
                   device) -> Calibration:
    """The calibration batches' input to the first decoder layer (fp32 hidden states, and the keyword
    arguments the model passes its layers)."""
    outside = _outside(model, prefix)
    dtypes = [_to_work(m, device, recurse=False) for m in outside]
    calib = Calibration([], [], [])

    def grab(module, args, kw):
        kw = dict(kw)
        hidden = args[0] if args else kw.pop("hidden_states")
        calib.hidden.append(hidden.detach().float())
        calib.kwargs.append({k: _float32(v) for k, v in kw.items()})
        raise _Stop

    hook = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            for batch in calibration_batches(examples):
                width = max(examples[i].numel() for i in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                real = torch.zeros(len(batch), width, dtype=torch.bool)
                for row, i in enumerate(batch):
                    ids[row, : examples[i].numel()] = examples[i]
                    real[row, : examples[i].numel()] = True
                calib.real.append(real.to(device))
                try:
                    model(input_ids=ids.to(device), use_cache=False)      # causal: no mask needed
                except _Stop:
                    pass
    finally:
        hook.remove()
        for m, d in zip(outside, dtypes):
            _to_host(m, d, recurse=False)
    return calib


def _layer_output(out):
    return out[0] if isinstance(out, tuple) else out


def find_input_sets(block: nn.Module, names: list[str], hidden: torch.Tensor, kwargs: dict) -> list[list[str]]:
    """The linears of `block` grouped by the tensor they read, in the order they run."""
    seen: list[tuple[torch.Tensor, list[str]]] = []
    hooks = []

    def record(name):
        def hook(module, args):
            x = args[0]
            for tensor, group in seen:
                if tensor is x:
                    group.append(name)
                    return
            seen.append((x, [name]))
        return hook

    for name in names:
        hooks.append(block.get_submodule(name).register_forward_pre_hook(record(name)))
    try:
        with torch.no_grad():
            block(hidden, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    sets = [group for _, group in seen]
    unused = [n for n in names if not any(n in s for s in sets)]
    return sets + [[n] for n in unused]


def real_rows(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """A linear layer's input as rows [tokens, features], padding dropped."""
    rows = x.detach().reshape(-1, x.shape[-1])
    return rows[real.reshape(-1)] if rows.shape[0] == real.numel() else rows


def collect_hessians(block: nn.Module, sets: list[list[str]], calib: Calibration,
                     stop_after: bool) -> list[torch.Tensor | None]:
    """H = 2/N X^T X for each set (over the N real tokens of every batch); with `stop_after` the forward
    pass stops once the last set has its input (a set never run gets None)."""
    hessians: list[torch.Tensor | None] = [None] * len(sets)
    counts = [0] * len(sets)
    done: set[int] = set()
    current: dict[str, torch.Tensor] = {}

    def accumulate(index):
        def hook(module, args):
            x = real_rows(args[0], current["real"]).float()
            h = x.t() @ x
            hessians[index] = h if hessians[index] is None else hessians[index] + h
            counts[index] += x.shape[0]
            done.add(index)
            if stop_after and len(done) == len(sets):
                raise _Stop
        return hook

    hooks = [block.get_submodule(s[0]).register_forward_pre_hook(accumulate(i)) for i, s in enumerate(sets)]
    try:
        with torch.no_grad():
            for hidden, kw, real in zip(calib.hidden, calib.kwargs, calib.real):
                done.clear()
                current["real"] = real
                try:
                    block(hidden, **kw)
                except _Stop:
                    pass
    finally:
        for h in hooks:
            h.remove()
    return [None if h is None else h * (2.0 / max(n, 1)) for h, n in zip(hessians, counts)]


def quantize_set(block: nn.Module, names: list[str], hessian: torch.Tensor | None, spec: QuantSpec,
                 layer_index: int) -> SetReport:
    """Quantize the linears `names` of `block` (sharing one input, so one Hessian) in one sweep and swap
    each for a GptqLinear holding its codes."""
    from ..backends.torch.gptq_linear import GptqLinear

    linears = [block.get_submodule(n) for n in names]
    weight = torch.cat([m.weight.detach().float() for m in linears], dim=0)
    rtn = round_to_nearest(weight, spec)
    if hessian is None:              # never run on the calibration data: nothing to calibrate on
        swept = SweepResult(rtn, spec.damp_percent, 0, True)
        error_rtn = error_gptq = float("nan")
    else:
        swept = gptq_quantize(weight, hessian, spec)
        error_rtn = output_error(weight, rtn.dequantize(), hessian)
        error_gptq = output_error(weight, swept.weight.dequantize(), hessian)
    row = 0
    for name, linear in zip(names, linears):
        part = swept.weight.rows(row, row + linear.out_features)
        row += linear.out_features
        packed = part.pack(spec.bits, linear.bias)
        block.set_submodule(name, GptqLinear.from_packed(packed, spec.bits, spec.group_size, torch.float32))
    return SetReport(layer_index, names, swept.damp_percent, swept.attempts, swept.fallback, error_gptq, error_rtn)


def quantize_model(model: nn.Module, examples: list, spec: QuantSpec, device, modules="all-linear",
                   true_sequential: bool = True, echo=print) -> GptqReport:
    """GPTQ every selected linear of the model's decoder layers, in place (they become GptqLinear layers).

    `examples`: token id sequences (numpy or torch), each run alone. `model` lives in host memory;
    `device` is where the work happens, one decoder layer at a time."""
    if not examples:
        raise MudpuppyError("GPTQ needs calibration examples; none were given")
    examples = [torch.as_tensor(e).to(torch.long).reshape(-1) for e in examples]
    if any(e.numel() == 0 for e in examples):
        raise MudpuppyError("GPTQ calibration: an example has no tokens")
    started = time.perf_counter()
    device = torch.device(device)
    prefix, layers, chosen = plan_linears(model, modules)
    host_dtype = next(model.parameters()).dtype
    report = GptqReport(layers=len(layers), calibration_examples=len(examples),
                        calibration_tokens=sum(int(e.numel()) for e in examples))
    calib = capture_inputs(model, prefix, layers, examples, device)
    for index, block in enumerate(layers):
        t0 = time.perf_counter()
        dtypes = _to_work(block, device)
        sets = find_input_sets(block, chosen, calib.hidden[0], calib.kwargs[0])
        if true_sequential:
            for names in sets:
                (hessian,) = collect_hessians(block, [names], calib, stop_after=True)
                report.sets.append(quantize_set(block, names, hessian, spec, index))
                del hessian
        else:
            hessians = collect_hessians(block, sets, calib, stop_after=False)
            for names, hessian in zip(sets, hessians):
                report.sets.append(quantize_set(block, names, hessian, spec, index))
            del hessians
        with torch.no_grad():       # the next layer's inputs, through this layer's quantized weights
            calib.hidden = [_layer_output(block(hidden, **kw)) for hidden, kw in zip(calib.hidden, calib.kwargs)]
        _to_host(block, dtypes)
        for m in block.modules():
            if hasattr(m, "qweight"):
                m.weight_dtype = host_dtype
        report.linears += len(chosen)
        done = [s for s in report.sets if s.layer == index]
        worst = max((s.error_gptq for s in done), default=0.0)
        echo(f"  layer {index} ({index + 1} of {len(layers)}): {len(chosen)} linears in {len(done)} sets, "
             f"largest relative output error {worst:.2e}"
             + (f", {sum(s.fallback for s in done)} set(s) rounded to nearest" if any(s.fallback for s in done)
                else "") + f" ({time.perf_counter() - t0:.1f} s)")
    report.seconds = time.perf_counter() - started
    return report


def round_to_nearest_model(model: nn.Module, spec: QuantSpec, modules="all-linear") -> int:
    """Replace the selected weights with their round-to-nearest values on the same grids (fp16 scales), in
    place and in the weights' own dtype: the baseline GPTQ is compared with. Returns the layers changed."""
    _, layers, chosen = plan_linears(model, modules)
    changed = 0
    with torch.no_grad():
        for block in layers:
            for name in chosen:
                linear = block.get_submodule(name)
                weight = linear.weight
                if not isinstance(weight, nn.Parameter):
                    raise MudpuppyError(f"{name}: this layer keeps its weight outside the module (streamed or "
                                        "quantized); round-to-nearest needs the plain weight")
                weight.copy_(round_to_nearest(weight, spec).dequantize().to(weight.dtype))
                changed += 1
    return changed


# --------------------------------------------------------------------------- loading and saving


def load_host_model(directory: Path, trust_remote_code: bool = False):
    """The model of `directory` in host memory at its checkpoint's dtype (bf16 stays bf16): the layers
    visit the device one at a time."""
    from ..backends.torch.loading import FrozenPlan, compact_dtype, load_model_weights

    dtype = compact_dtype(Path(directory)) or torch.float32
    model, _ = load_model_weights("AutoModelForCausalLM", Path(directory), dtype, torch.device("cpu"),
                                  lambda m: FrozenPlan(), trust_remote_code)
    model.config.use_cache = False
    model.eval()
    return model


SHARD_BYTES = 4 * 2**30


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_quantized(model: nn.Module, out: Path, quantization_config: dict, source: Path | None = None) -> list[str]:
    """Write the quantized model in the GPTQ layout: safetensors (sharded past 4 GiB, with an index),
    config.json with `quantization_config`, and the source's generation_config.json. Returns the files."""
    import copy
    import json
    import os
    import shutil

    from safetensors.torch import save_file

    from ..backends.torch.gptq_linear import GptqLinear

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    gptq_bias = {f"{name}.bias" for name, m in model.named_modules() if isinstance(m, GptqLinear) and m.bias is not None}
    state = {}
    for key, tensor in model.state_dict().items():
        if key in tied:
            continue
        tensor = tensor.detach().to("cpu")
        state[key] = (tensor.to(torch.float16) if key in gptq_bias else tensor).contiguous().clone()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    files = []
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        files.append("model.safetensors")
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            files.append(name)
        total = sum(t.numel() * t.element_size() for t in state.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        files.append("model.safetensors.index.json")
    config = copy.deepcopy(model.config)
    config.quantization_config = quantization_config
    config.use_cache = True
    config.dtype = next(model.parameters()).dtype       # of the tensors kept in full precision
    config.save_pretrained(str(out))
    files.append("config.json")
    for name in files:                                   # safetensors writes 0600; a model is meant to be shared
        os.chmod(out / name, 0o644 & ~_umask())
    if source is not None and (Path(source) / "generation_config.json").is_file():
        shutil.copyfile(Path(source) / "generation_config.json", out / "generation_config.json")
        files.append("generation_config.json")
    return files
