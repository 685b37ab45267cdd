"""GPTQ over a model, decoder layer by decoder layer (the sweep of one weight matrix is sweep.py).

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

import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .....errors import MudpuppyError
from ...model.frozen import FrozenLinear
from .format import check_packable
from .linear import GptqLinear
from .sweep import QuantSpec, SweepResult, gptq_quantize, output_error, round_to_nearest

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
