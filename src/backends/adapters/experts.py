"""Mixture-of-experts experts between PEFT's layout and mlx-lm's.

PEFT's ``target_parameters`` LoRA on a fused 3-D tensor (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``) is one rank-r pair per expert, stored as ``<experts>[.base_layer].lora_A.weight``
[E*r, in] and ``lora_B.weight`` [out, r*E]; a module with both tensors targeted nests two wrappers. mlx-lm
holds LoRASwitchLinear pairs on ``gate_proj``, ``up_proj`` (the same A twice, B's two parts) and
``down_proj``. Where the SwitchGLU sits and how gate_up's rows hold gate and up is the model's, recorded by
the MLX backend (`Adapter.expert_layout`). See the package's docstring for the whole table.
"""

from __future__ import annotations

import numpy as np

from .neutral import _LAYER_PATH, Adapter, ExpertAdapter
from .tensors import AdapterError, RawTensor

# The fused expert tensors PEFT's target_parameters may adapt, in the order experts modules define them
# (which is PEFT's nesting order: the first is wrapped innermost).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
MLX_STACKS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def split_rows(fused: np.ndarray, split: str, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(gate, up) out of gate_up_proj's output rows: halves (Qwen3-MoE, Mixtral) or interleaved (gpt-oss)."""
    index = [slice(None)] * fused.ndim
    half = fused.shape[axis] // 2
    parts = (slice(0, None, 2), slice(1, None, 2)) if split == "interleaved" else (slice(0, half), slice(half, None))
    out = []
    for part in parts:
        index[axis] = part
        out.append(np.ascontiguousarray(fused[tuple(index)]))
    return out[0], out[1]


def join_rows(gate: np.ndarray, up: np.ndarray, split: str, axis: int) -> np.ndarray:
    if split != "interleaved":
        return np.concatenate([gate, up], axis=axis)
    out = np.stack([gate, up], axis=axis + 1 if axis >= 0 else axis)
    shape = list(gate.shape)
    shape[axis] *= 2
    return out.reshape(shape)


def expert_targets(target_parameters, where) -> list[tuple[str, str]]:
    """PEFT's target_parameters as (module suffix, tensor name); only fused expert tensors convert."""
    out = []
    for target in target_parameters:
        module, _, param = str(target).rpartition(".")
        if param not in EXPERT_PARAMS or not module:
            raise AdapterError(f"{where}: target_parameters {target!r}: only fused expert tensors "
                               f"({', '.join(EXPERT_PARAMS)}) convert to mlx-lm")
        out.append((module, param))
    return out


def expert_param(path: str, wrapped: list[tuple[str, str]]) -> str | None:
    """The fused tensor a PEFT key's module path adapts (``experts.base_layer`` -> gate_up_proj), or None.

    PEFT nests one lora.ParamWrapper per targeted tensor of a module, the first the module defines
    innermost: with n of them, the wrapper under d ``.base_layer`` hops adapts the (n-1-d)-th."""
    if not wrapped:
        return None
    parts = path.split(".")
    depth = 0
    while parts and parts[-1] == "base_layer":
        parts.pop()
        depth += 1
    module = ".".join(parts)
    params = [p for p in EXPERT_PARAMS
              if any(p == param and (module == m or module.endswith("." + m)) for m, param in wrapped)]
    if not params:
        return None
    if depth >= len(params):
        raise AdapterError(f"PEFT key {path}: nested deeper than the {len(params)} expert tensor(s) it targets")
    return f"{module}.{params[len(params) - 1 - depth]}"


def _check_experts(found: dict[str, dict[str, RawTensor]], r: int, where) -> dict[str, ExpertAdapter]:
    out = {}
    for path, parts in sorted(found.items()):
        if "a" not in parts or "b" not in parts:
            raise AdapterError(f"{where}: {path} has only one of its two LoRA matrices")
        a, b = parts["a"].array, parts["b"].array
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] % r or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{where}: {path} has A {a.shape} and B {b.shape}, which do not fit rank {r} "
                               "per expert")
        out[path] = ExpertAdapter(parts["a"], parts["b"])
    return out


def experts_from_mlx(tensors: dict[str, RawTensor], layout: dict[str, tuple[str, str]], r: int,
                     where) -> dict[str, ExpertAdapter]:
    """The expert adapters of an mlx-lm copy mudpuppy wrote (its LoRASwitchLinear pairs on gate_proj,
    up_proj, down_proj) back in PEFT's fused layout; removes their tensors from `tensors`."""
    out = {}
    for module, (stem, split) in sorted(layout.items()):
        for param, stacks in MLX_STACKS.items():
            names = [f"{stem}.{s}.{leaf}" for s in stacks for leaf in ("lora_a", "lora_b")]
            present = [n for n in names if n in tensors]
            if not present:
                continue
            if len(present) != len(names):
                raise AdapterError(f"{where}: {stem}: expert adapter incomplete (has {', '.join(present)})")
            got = {n: tensors.pop(n) for n in names}
            dtype = got[names[0]].dtype
            a = got[f"{stem}.{stacks[0]}.lora_a"].array
            if a.ndim != 3 or a.shape[1] != r:
                raise AdapterError(f"{where}: {stem}.{stacks[0]}.lora_a {a.shape} is not [experts, {r}, in]")
            if param == "gate_up_proj":
                if not got[f"{stem}.up_proj.lora_a"].equals(got[f"{stem}.gate_proj.lora_a"]):
                    raise AdapterError(
                        f"{where}: {stem}: gate_proj and up_proj hold different lora_a, i.e. two pairs; PEFT's "
                        "LoRA on the fused gate_up_proj is one pair per expert (train it with mudpuppy)")
                b = join_rows(got[f"{stem}.gate_proj.lora_b"].array, got[f"{stem}.up_proj.lora_b"].array, split, 1)
            else:
                b = got[f"{stem}.down_proj.lora_b"].array
            out[f"{module}.{param}"] = ExpertAdapter.from_factors(dtype, a, b)
    left = [n for n, t in tensors.items() if t.array.ndim == 3]
    if left:
        raise AdapterError(f"{where}: {left[0]} belongs to a mixture-of-experts LoRA this file does not map to "
                           "PEFT's fused experts (mlx-lm's own gate and up pairs have no PEFT equivalent)")
    return out


def peft_expert_key(adapter: Adapter, path: str) -> str:
    """PEFT's module name for a fused tensor's wrapper: the experts module, one ``.base_layer`` per wrapper
    nested outside it (expert_param's rule, backwards)."""
    module, _, param = path.rpartition(".")
    params = [p for p in EXPERT_PARAMS if f"{module}.{p}" in adapter.experts]
    return module + ".base_layer" * (len(params) - 1 - params.index(param))


def mlx_expert_tensors(adapter: Adapter) -> dict[str, RawTensor]:
    """The expert adapters as mlx-lm's LoRASwitchLinear pairs: lora_a [E, r, in], lora_b [E, out, r]."""
    out = {}
    for path, ea in adapter.experts.items():
        module, _, param = path.rpartition(".")
        if module not in adapter.expert_layout:
            raise AdapterError(f"{module}: an expert adapter needs the MLX model's layout to be written in mlx-lm's "
                               "form; load the adapter on the mlx backend and save it from there")
        stem, split = adapter.expert_layout[module]
        a, b = ea.factors(adapter.r)
        dtype = ea.lora_a.dtype
        if param == "gate_up_proj":
            gate, up = split_rows(b, split, 1)
            for stack, part in (("gate_proj", gate), ("up_proj", up)):
                out[f"{stem}.{stack}.lora_a"] = RawTensor(dtype, a)
                out[f"{stem}.{stack}.lora_b"] = RawTensor(dtype, part)
        else:
            out[f"{stem}.down_proj.lora_a"] = RawTensor(dtype, a)
            out[f"{stem}.down_proj.lora_b"] = RawTensor(dtype, b)
    return out


def expert_keys(adapter: Adapter) -> set[str]:
    names = mlx_expert_tensors(adapter) if adapter.experts else {}
    return {(m.group(2) if (m := _LAYER_PATH.match(n)) else n).rpartition(".")[0] for n in names}
