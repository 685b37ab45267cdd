"""mlx-lm's side: an adapters.safetensors + adapter_config.json directory into the neutral form and back.
An mlx-lm copy written by mudpuppy carries the PEFT config it came from (under MUDPUPPY_KEY), so
PEFT -> mlx-lm -> PEFT gives back identical files."""

from __future__ import annotations

from pathlib import Path

from ...files import write_json_atomic
from .experts import expert_keys, experts_from_mlx, mlx_expert_tensors
from .neutral import CONFIG_FILE, HEAD_TASKS, MLX_WEIGHTS, MUDPUPPY_KEY, Adapter, _check_modules, is_head_weight
from .peft_format import peft_config_for
from .tensors import AdapterError, RawTensor, write_safetensors


def adapter_from_mlx(config: dict, tensors: dict[str, RawTensor], where: Path | str = "<mlx>") -> Adapter:
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise AdapterError(f"{where}: fine_tune_type {kind!r} is a full fine-tune, not an adapter; "
                           "only lora and dora adapters convert")
    params = config.get("lora_parameters") or {}
    if "rank" not in params or "scale" not in params:
        raise AdapterError(f"{where}: lora_parameters must give rank and scale (mlx-lm's adapter_config schema)")
    modules: dict[str, dict[str, RawTensor]] = {}
    full: dict[str, RawTensor] = {}
    leaves = {"lora_a": "a", "lora_b": "b", "m": "m"}
    ours = config.get(MUDPUPPY_KEY) or {}
    layout = {m: (v["mlx"], v["split"]) for m, v in (ours.get("experts") or {}).items()}
    tensors = dict(tensors)
    experts = experts_from_mlx(tensors, layout, int(params["rank"]), where)   # takes its tensors out
    for name, tensor in tensors.items():
        if is_head_weight(name):
            full[name] = tensor
            continue
        path, _, leaf = name.rpartition(".")
        if leaf not in leaves or not path:
            raise AdapterError(f"{where}: tensor {name!r} is not a lora_a/lora_b/m adapter weight")
        if tensor.array.ndim != (1 if leaf == "m" else 2) or "embed" in path.rsplit(".", 1)[-1]:
            raise AdapterError(f"{where}: {name} belongs to a mixture-of-experts or embedding LoRA, "
                               "which PEFT's LoRA layout does not share")
        # PEFT orientation: A [r, in], B [out, r].
        modules.setdefault(path, {})[leaves[leaf]] = tensor if leaf == "m" else tensor.transposed()
    r = int(params["rank"])
    peft_config = ours.get("peft_config")
    rslora = bool(peft_config.get("use_rslora")) if peft_config else False
    scale = float(params["scale"])
    alpha = float(peft_config["lora_alpha"]) if peft_config else scale * r
    task = ours.get("task_type") or (peft_config or {}).get("task_type") or "CAUSAL_LM"
    if full and task not in HEAD_TASKS:
        raise AdapterError(f"{where}: {', '.join(full)} is a trained head, but the config names no "
                           "classification task (mudpuppy.task_type SEQ_CLS or TOKEN_CLS)")
    adapter = Adapter(
        kind=kind, r=r, alpha=alpha, modules=_check_modules(modules, r, kind == "dora", where, bool(experts)),
        rslora=rslora, dropout=float(params.get("dropout") or 0.0), base_model=config.get("model"),
        peft_config=peft_config, num_layers=int(config.get("num_layers", -1)), task_type=task, full=full,
        extra={k: v for k, v in ours.items() if k not in ("peft_config", "task_type", "experts")},
        experts=experts, expert_layout=layout)
    if peft_config is not None and abs(adapter.scale - scale) > 1e-6 * max(1.0, abs(scale)):
        raise AdapterError(f"{where}: lora_parameters.scale {scale} disagrees with the PEFT config it records "
                           f"(lora_alpha {alpha}, r {r} give {adapter.scale}); the file was edited by hand")
    return adapter


def mlx_config_for(adapter: Adapter) -> dict:
    ours = dict(adapter.extra)
    if adapter.expert_layout:
        ours["experts"] = {m: {"mlx": stem, "split": split} for m, (stem, split) in adapter.expert_layout.items()}
    ours["peft_config"] = peft_config_for(adapter)
    if adapter.full:
        ours["task_type"] = adapter.task_type
    return {
        "fine_tune_type": adapter.kind,
        # -1 is mlx-lm's "every block": adapters may sit on any subset of blocks, and
        # mlx-lm's extra layers then start with B = 0 (LoRA) or m = |W| (DoRA), changing nothing.
        "num_layers": -1,
        "lora_parameters": {"rank": adapter.r, "scale": adapter.scale, "dropout": adapter.dropout,
                            "keys": sorted(set(adapter.block_keys()) | expert_keys(adapter))},
        "model": adapter.base_model,
        MUDPUPPY_KEY: ours,
    }


def write_mlx(adapter: Adapter, out: str | Path) -> Path:
    root = Path(out)
    tensors = mlx_expert_tensors(adapter)     # refused before anything is written where it cannot be
    root.mkdir(parents=True, exist_ok=True)
    for path, mod in adapter.modules.items():
        tensors[f"{path}.lora_a"] = mod.lora_a.transposed()
        tensors[f"{path}.lora_b"] = mod.lora_b.transposed()
        if mod.magnitude is not None:
            tensors[f"{path}.m"] = mod.magnitude
    tensors.update(adapter.full)   # a trained head keeps its model name (score.weight), as mlx-lm's weights do
    write_safetensors(root / MLX_WEIGHTS, tensors, {"format": "mlx"})
    write_json_atomic(root / CONFIG_FILE, mlx_config_for(adapter))
    return root
