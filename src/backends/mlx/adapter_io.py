"""Between a live MLX model and the neutral adapter form of `backends.adapters`.

Saving writes the PEFT layout at the top of the directory (plain
`peft.PeftModel.from_pretrained` loads it) and mlx-lm's layout in `mlx/`
(`mlx_lm.load(..., adapter_path=...)` loads it). Loading takes either.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ...errors import MudpuppyError
from .. import adapters as fmt
from ..provenance import base_record_of_path
from .experts import SPLITS, TARGETS, expert_adapters, expert_modules, torch_path, wrap_experts
from ..adapters.init import as_plain_lora, initial_factors, mutates_base
from .layers import adapter_layers, base_weight, linear_dims, linear_layers, wrap_linears
from .loading import HEAD_NAME


def to_raw(array: mx.array) -> fmt.RawTensor:
    if array.dtype == mx.bfloat16:
        return fmt.RawTensor("BF16", np.array(array.view(mx.uint16)))
    if array.dtype == mx.float16:
        return fmt.RawTensor("F16", np.array(array))
    return fmt.RawTensor("F32", np.array(array.astype(mx.float32)))


def from_raw(tensor: fmt.RawTensor) -> mx.array:
    if tensor.dtype == "BF16":
        return mx.array(tensor.array).view(mx.bfloat16)
    return mx.array(tensor.array)


def adapter_from_model(handle) -> fmt.Adapter:
    spec = handle.adapter
    if not spec or spec.get("kind") == "none":
        raise MudpuppyError("save_adapter: no LoRA or DoRA adapter is attached to this model; "
                            "a full fine-tune is saved with save_model")
    modules = {}
    for path, layer in adapter_layers(handle.model).items():
        magnitude = to_raw(layer.m) if "m" in layer else None
        # PEFT orientation: A [r, in], B [out, r].
        modules[path] = fmt.ModuleAdapter(to_raw(layer.lora_a.T), to_raw(layer.lora_b.T), magnitude)
    extra = {"quantization": spec["quantization"]} if spec.get("quantization") else {}
    # A scalar head trains in full beside the adapter; PEFT saves it as modules_to_save of its task.
    full = ({f"{HEAD_NAME}.{k}": to_raw(v) for k, v in tree_flatten(handle.model[HEAD_NAME].parameters())}
            if handle.head else {})
    task = {"sequence_classification": "SEQ_CLS", "token_classification": "TOKEN_CLS"}.get(handle.head, "CAUSAL_LM")
    experts, layout = {}, {}
    for stem, glu in expert_adapters(handle.model).items():
        module = torch_path(stem, handle.config.get("model_type"))
        layout[module] = (stem, glu.split)
        for pair, param in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
            if pair in glu:
                a, b = to_raw(glu[pair].lora_a), to_raw(glu[pair].lora_b)   # [E, r, in], [E, out, r]
                experts[f"{module}.{param}"] = fmt.ExpertAdapter.from_factors(a.dtype, a.array, b.array)
    return fmt.Adapter(kind=spec["kind"], r=spec["r"], alpha=spec["alpha"], modules=modules,
                       rslora=spec["rslora"], dropout=spec["dropout"], base_model=handle.source,
                       peft_config=spec.get("peft_config"), target_modules=spec.get("targets"), extra=extra,
                       task_type=task, full=full, experts=experts, expert_layout=layout)


def initialise(handle, init: str) -> None:
    """adapter.init on the freshly wrapped layers: PEFT's gaussian A (std 1/r), or PiSSA's / OLoRA's
    factors from each base weight with the base replaced by their residual, computed as on torch
    (adapters/init.py) and kept in handle.adapter["initial"] for `save_adapter`. default: as wrapped."""
    layers = adapter_layers(handle.model)
    if init == "gaussian":
        for layer in layers.values():
            layer.lora_a = mx.random.normal(layer.lora_a.shape) / layer.lora_a.shape[1]
    elif mutates_base(init):
        if expert_adapters(handle.model):
            raise MudpuppyError(f"adapter.init {init}: this model's fused experts take PEFT's adapter, which "
                                "PiSSA and OLoRA do not factor; list target_modules without the experts")
        quantized = sorted(p for p, layer in layers.items() if isinstance(layer.linear, nn.QuantizedLinear))
        if quantized:
            raise MudpuppyError(f"adapter.init {init}: {quantized[0]} and {len(quantized) - 1} more are quantized, and "
                                "PiSSA / OLoRA replace each weight by a float residual; load an unquantized base")
        initial = {}
        for path, layer in layers.items():
            a, b, residual = initial_factors(init, np.array(base_weight(layer.linear).astype(mx.float32)),
                                             layer.lora_a.shape[1], layer.scale)
            layer.lora_a, layer.lora_b = mx.array(a.T), mx.array(b.T)
            layer.linear.weight = mx.array(residual).astype(layer.linear.weight.dtype)
            initial[path] = (a, b)
        handle.adapter["initial"] = initial
    mx.eval(handle.model.parameters())


def save_adapter(handle, path: str) -> None:
    adapter = adapter_from_model(handle)
    if handle.adapter.get("initial"):    # PiSSA / OLoRA: a plain LoRA on the original base (adapters/init.py)
        adapter = as_plain_lora(adapter, handle.adapter["initial"])
    fmt.write_peft(adapter, path)
    fmt.write_mlx(adapter, Path(path) / fmt.MLX_SUBDIR)
    fmt.record_base(path, base_record_of_path(handle.source))   # the base named portably, the exact one beside


def load_adapter(handle, path: str, trainable: bool = False) -> None:
    """Attach the adapter stored at `path` (PEFT or mlx-lm layout) to a model that has none."""
    if adapter_layers(handle.model) or expert_adapters(handle.model):
        raise MudpuppyError(f"load_adapter {path}: this model already has an adapter attached")
    adapter = fmt.read_adapter(path)
    linears = linear_layers(handle.model)
    missing = [p for p in adapter.modules if p not in linears]
    if missing:
        raise MudpuppyError(
            f"load_adapter {path}: {len(missing)} adapted module(s) do not exist in this model, "
            f"e.g. {', '.join(missing[:3])}; was the adapter trained on another base model?")
    for p, mod in adapter.modules.items():
        in_dims, out_dims = linear_dims(linears[p])
        if mod.lora_a.array.shape[1] != in_dims or mod.lora_b.array.shape[0] != out_dims:
            raise MudpuppyError(f"load_adapter {path}: {p} is [{out_dims} x {in_dims}] in this model but the "
                                f"adapter expects [{mod.lora_b.array.shape[0]} x {mod.lora_a.array.shape[1]}]")
    stems = expert_stems(handle, adapter, path)
    wrap_linears(handle.model, sorted(adapter.modules), adapter.kind, adapter.r, adapter.scale, adapter.dropout)
    if stems:
        wrap_experts(handle.model, sorted(set(stems.values())), adapter.r, adapter.scale,
                     SPLITS[handle.config["model_type"]][1], expert_targets(adapter))
    handle.model.load_weights(adapter_weights(handle, adapter, path), strict=False)
    if trainable and handle.head:
        handle.model[HEAD_NAME].unfreeze()  # the head trains in full, as after attach_adapter
    if not trainable:
        handle.model.freeze()  # as PEFT's from_pretrained: loaded for inference unless asked otherwise
    mx.eval(handle.model.parameters())
    handle.adapter = {"kind": adapter.kind, "r": adapter.r, "alpha": adapter.alpha, "rslora": adapter.rslora,
                      "dropout": adapter.dropout, "targets": adapter.block_keys(), "peft_config": adapter.peft_config,
                      "quantization": adapter.extra.get("quantization"), "experts": expert_targets(adapter)}


def expert_targets(adapter: fmt.Adapter) -> list[str]:
    """Which of TARGETS the adapter's expert LoRA covers (the same on every layer, as PEFT targets by name)."""
    return [t for t in TARGETS if any(p.endswith("." + t.split(".")[1]) for p in adapter.experts)]


def expert_stems(handle, adapter: fmt.Adapter, path: str) -> dict[str, str]:
    """Fused expert tensor (PEFT's name) -> the SwitchGLU path in this model that carries it, shapes checked."""
    if not adapter.experts:
        return {}
    model_type = handle.config.get("model_type")
    glus = expert_modules(handle.model)
    if model_type not in SPLITS or not glus:
        raise MudpuppyError(f"load_adapter {path}: the adapter adapts fused experts, which this model "
                            f"({model_type}) has none of on the mlx backend that mudpuppy can adapt")
    if adapter.kind != "lora":
        raise MudpuppyError(f"load_adapter {path}: a {adapter.kind} adapter on fused experts; PEFT adapts them with "
                            "LoRA only")
    by_module = {torch_path(stem, model_type): stem for stem in glus}
    out = {}
    for name, ea in adapter.experts.items():
        module, _, param = name.rpartition(".")
        if module not in by_module:
            raise MudpuppyError(f"load_adapter {path}: {name} has no mixture-of-experts layer in this model; "
                                "was the adapter trained on another base model?")
        stack = glus[by_module[module]].gate_proj
        experts, inter, hidden = stack.num_experts, stack.output_dims, stack.input_dims
        want = (experts * adapter.r, hidden, 2 * inter) if param == "gate_up_proj" else (experts * adapter.r, inter, hidden)
        got = (ea.lora_a.array.shape[0], ea.lora_a.array.shape[1], ea.lora_b.array.shape[0])
        if got != want:
            raise MudpuppyError(f"load_adapter {path}: {name} is {experts} experts [{want[2]} x {want[1]}] at rank "
                                f"{adapter.r} in this model but the adapter holds A {ea.lora_a.array.shape}, "
                                f"B {ea.lora_b.array.shape}")
        out[name] = by_module[module]
    return out



def adapter_weights(handle, adapter: fmt.Adapter, path: str) -> list[tuple[str, mx.array]]:
    """The adapter's matrices (and trained head) under the names the wrapped model uses."""
    weights = []
    for p, mod in adapter.modules.items():
        weights.append((f"{p}.lora_a", from_raw(mod.lora_a.transposed())))
        weights.append((f"{p}.lora_b", from_raw(mod.lora_b.transposed())))
        if mod.magnitude is not None:
            weights.append((f"{p}.m", from_raw(mod.magnitude)))
    for name, stem in expert_stems(handle, adapter, path).items():
        a, b = adapter.experts[name].factors(adapter.r)
        dtype = adapter.experts[name].lora_a.dtype
        pair = "gate_up" if name.endswith("gate_up_proj") else "down"
        weights.append((f"{stem}.{pair}.lora_a", from_raw(fmt.RawTensor(dtype, a))))
        weights.append((f"{stem}.{pair}.lora_b", from_raw(fmt.RawTensor(dtype, b))))
    return weights + head_weights(handle, adapter, path)


def start_from(handle, path: str) -> None:
    """adapter.init_from: the attached (fresh) adapter takes the weights stored at `path`, which must be
    an adapter of the same kind, rank and modules (a previous stage of a curriculum, on any backend)."""
    adapter = fmt.read_adapter(path)
    mine = handle.adapter
    attached = set(adapter_layers(handle.model))
    problems = []
    if adapter.kind != mine["kind"] or adapter.r != mine["r"]:
        problems.append(f"it is {adapter.kind} r={adapter.r}, this run attaches {mine['kind']} r={mine['r']}")
    experts = {f"{torch_path(stem, handle.config.get('model_type'))}.{param}"
               for stem, glu in expert_adapters(handle.model).items()
               for pair, param in (("gate_up", "gate_up_proj"), ("down", "down_proj")) if pair in glu}
    if set(adapter.experts) != experts:
        problems.append(f"it adapts {len(adapter.experts)} fused expert tensors, this run {len(experts)}")
    if set(adapter.modules) != attached:
        problems.append(f"it adapts {len(adapter.modules)} modules, this run {len(attached)} "
                        f"(e.g. {', '.join(sorted(set(adapter.modules) ^ attached)[:3])})")
    if problems:
        raise MudpuppyError(f"adapter.init_from {path}: {'; '.join(problems)}; use the same adapter settings as "
                            "the run that wrote it")
    handle.model.load_weights(adapter_weights(handle, adapter, path), strict=False)
    mx.eval(handle.model.parameters())


def head_weights(handle, adapter: fmt.Adapter, path: str) -> list[tuple[str, mx.array]]:
    """The trained head an adapter carries, checked against the model's own head."""
    if not adapter.full:
        return []
    if not handle.head:
        raise MudpuppyError(f"load_adapter {path}: the adapter carries a trained head ({', '.join(adapter.full)}); "
                            "load the model with its head (method rm or prm)")
    own = dict(tree_flatten(handle.model[HEAD_NAME].parameters()))
    out = []
    for name, tensor in adapter.full.items():
        leaf = name.split(".", 1)[1]
        if leaf not in own or tuple(own[leaf].shape) != tuple(tensor.array.shape):
            raise MudpuppyError(f"load_adapter {path}: the adapter's {name} {tuple(tensor.array.shape)} does not "
                                f"fit this model's head ({', '.join(f'{k} {tuple(v.shape)}' for k, v in own.items())})")
        out.append((f"{HEAD_NAME}.{leaf}", from_raw(tensor)))
    return out
