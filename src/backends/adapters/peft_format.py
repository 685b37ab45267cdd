"""PEFT's side: an adapter_model.safetensors + adapter_config.json directory into the neutral form and back.
PEFT options with no faithful mlx-lm equivalent are refused rather than converted wrongly."""

from __future__ import annotations

from pathlib import Path

from ...files import write_json_atomic
from .experts import _check_experts, expert_param, expert_targets, peft_expert_key
from .neutral import (
    CONFIG_FILE, HEAD_MODULES, HEAD_TASKS, PEFT_PREFIX, PEFT_WEIGHTS, Adapter, _check_modules, is_head_weight,
)
from .tensors import AdapterError, RawTensor, write_safetensors

# PEFT options that change what the weights mean; an adapter using any of them
# has no faithful mlx-lm equivalent, so it is refused rather than converted wrongly.
PEFT_UNCONVERTIBLE = {
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "modules_to_save": "fully trained extra modules",
    "lora_bias": "trained LoRA biases",
    "fan_in_fan_out": "Conv1D (fan_in_fan_out) weights",
    "layer_replication": "layer replication",
    "trainable_token_indices": "trainable token embeddings",
    "use_qalora": "QA-LoRA",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
}


def adapter_from_peft(config: dict, tensors: dict[str, RawTensor], where: Path | str = "<peft>") -> Adapter:
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{where}: peft_type {config.get('peft_type')!r} is not convertible; only LoRA "
                           "and DoRA adapters (peft_type LORA) have an mlx-lm equivalent")
    task = config.get("task_type") or "CAUSAL_LM"
    head_only = task in HEAD_TASKS and set(config.get("modules_to_save") or []) <= set(HEAD_MODULES)
    used = [f"{key} ({why})" for key, why in PEFT_UNCONVERTIBLE.items()
            if config.get(key) and not (key == "modules_to_save" and head_only)]
    if used:
        raise AdapterError(f"{where}: this adapter uses {', '.join(used)}, which mlx-lm adapters cannot express")
    modules: dict[str, dict[str, RawTensor]] = {}
    full: dict[str, RawTensor] = {}
    expert_parts: dict[str, dict[str, RawTensor]] = {}
    wrapped = expert_targets(config.get("target_parameters") or [], where)
    suffixes = {".lora_A.weight": "a", ".lora_B.weight": "b", ".lora_magnitude_vector": "m",
                ".lora_magnitude_vector.weight": "m"}
    for name, tensor in tensors.items():
        if head_only and is_head_weight(name[len(PEFT_PREFIX):]) and name.startswith(PEFT_PREFIX):
            full[name[len(PEFT_PREFIX):]] = tensor
            continue
        hit = next((s for s in suffixes if name.endswith(s)), None)
        if hit is None or not name.startswith(PEFT_PREFIX):
            raise AdapterError(f"{where}: tensor {name!r} is not a LoRA A/B matrix or DoRA magnitude "
                               "(embedding LoRA and extra trained modules do not convert)")
        path = name[len(PEFT_PREFIX) : -len(hit)]
        if (param := expert_param(path, wrapped)) is not None:
            if hit not in (".lora_A.weight", ".lora_B.weight"):
                raise AdapterError(f"{where}: {name}: PEFT adapts fused experts without DoRA")
            expert_parts.setdefault(param, {})[suffixes[hit]] = tensor
            continue
        modules.setdefault(path, {})[suffixes[hit]] = tensor
    dora = bool(config.get("use_dora"))
    r = int(config["r"])
    experts = _check_experts(expert_parts, r, where)
    adapter = Adapter(
        kind="dora" if dora else "lora", r=r, alpha=float(config["lora_alpha"]),
        modules=_check_modules(modules, r, dora, where, allow_empty=bool(experts)),
        rslora=bool(config.get("use_rslora")),
        dropout=float(config.get("lora_dropout") or 0.0), base_model=config.get("base_model_name_or_path"),
        peft_config=config, task_type=task, full=full, experts=experts)
    return adapter


def peft_config_for(adapter: Adapter) -> dict:
    """The PEFT config to write: the original when there is one, else a minimal LoraConfig."""
    if adapter.peft_config is not None:
        return adapter.peft_config
    config = {
        "peft_type": "LORA", "task_type": adapter.task_type, "base_model_name_or_path": adapter.base_model,
        "r": adapter.r, "lora_alpha": _plain_number(adapter.alpha), "lora_dropout": adapter.dropout,
        "target_modules": adapter.target_modules or adapter.block_keys(), "use_dora": adapter.kind == "dora",
        "use_rslora": adapter.rslora, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": list(HEAD_MODULES) if adapter.full else None,
        "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
        "target_parameters": adapter.target_parameters() or None,
    }
    if adapter.num_layers != -1:
        # mlx-lm adapted only the last `num_layers` blocks; PEFT must not adapt the others.
        config["layers_to_transform"] = adapter.layer_indices()
    return config


def write_peft(adapter: Adapter, out: str | Path) -> Path:
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, mod in adapter.modules.items():
        tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"] = mod.lora_a
        tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"] = mod.lora_b
        if mod.magnitude is not None:
            tensors[f"{PEFT_PREFIX}{path}.lora_magnitude_vector"] = mod.magnitude
    tensors.update({f"{PEFT_PREFIX}{name}": tensor for name, tensor in adapter.full.items()})
    for path, ea in adapter.experts.items():
        tensors[f"{PEFT_PREFIX}{peft_expert_key(adapter, path)}.lora_A.weight"] = ea.lora_a
        tensors[f"{PEFT_PREFIX}{peft_expert_key(adapter, path)}.lora_B.weight"] = ea.lora_b
    write_safetensors(root / PEFT_WEIGHTS, tensors, {"format": "pt"})
    write_json_atomic(root / CONFIG_FILE, peft_config_for(adapter))
    return root


def _plain_number(value: float):
    return int(value) if float(value).is_integer() else value
