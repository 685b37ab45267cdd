"""Attaching an adapter on torch: PEFT's LoRA / DoRA (and QLoRA's, on a base quantized first), on linear
layers and on mixture-of-experts fused tensors (experts.py), or every weight trainable; which layers are
targets; its initialisation (adapter.init, lora_init.py); a curriculum stage's adapter as the starting point
(adapter.init_from); the frozen base kept in the compute dtype."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ....errors import MudpuppyError
from ...adapters import choose_target_modules, choose_target_parameters
from ...adapters.init import mutates_base, peft_init
from ...protocol import AdapterInfo
from .experts import warn_if_mostly_unadapted
from .frozen import FrozenLinear
from ..handle import HEADS, TorchModel, unwrap
from .lora_init import plain_targets, record_initial
from .vision import freeze_vision_tower, lora_targets


def attach_adapter(backend, handle: TorchModel, adapter_cfg) -> AdapterInfo:
    """PEFT's adapter on the loaded model (LoRA, DoRA, or QLoRA on the base quantized first), or every
    weight trainable (adapter.type none); the report of what trains, per target group."""
    from .experts import adapter_groups, base_weight_groups, find_moe, full_groups

    model = handle.model
    handle.adapter_type = adapter_cfg.type
    # Mixture-of-experts: fused expert tensors and routers (experts.py); empty for a dense model.
    layout = find_moe(unwrap(model))
    if adapter_cfg.type == "none":
        for p in model.parameters():
            p.requires_grad_(True)
        if handle.processor is not None and handle.freeze_vision:
            freeze_vision_tower(model)
        targets: list[str] = []
        groups = full_groups(unwrap(model), layout)
    else:
        from peft import LoraConfig, get_peft_model

        from .frozen import weight_reads_without_values

        if adapter_cfg.type == "qlora":
            quantization = backend.quantize_base(handle, adapter_cfg)
        base_counts = base_weight_groups(unwrap(model), layout)
        parameters: list[str] = []
        if handle.processor is not None:
            targets, spec = lora_targets(model, adapter_cfg.target_modules, handle.freeze_vision,
                                         choose_target_modules)
        else:
            spec = target_modules(model, adapter_cfg.target_modules, layout)
            parameters = choose_target_parameters(layout.target_names(), adapter_cfg.target_modules)
            targets = spec + parameters
        if parameters and (adapter_cfg.type == "dora" or adapter_cfg.dropout):
            raise MudpuppyError(
                f"adapter: this model's experts are fused tensors ({', '.join(parameters)}), which PEFT adapts "
                f"without {'DoRA' if adapter_cfg.type == 'dora' else 'dropout'}; use adapter.type lora (or qlora) "
                "with adapter.dropout: 0, or list target_modules without the experts")
        init = getattr(adapter_cfg, "init", "default")
        if parameters and mutates_base(init):
            raise MudpuppyError(f"adapter.init {init}: this model's experts are fused tensors ({', '.join(parameters)}), "
                                "which PEFT's PiSSA / OLoRA do not factor; list target_modules without the experts")
        task = HEADS[handle.head][2] if handle.head else "CAUSAL_LM"
        routers = layout.router_names() if getattr(adapter_cfg, "train_router", False) else []
        config = LoraConfig(
            r=adapter_cfg.r, lora_alpha=adapter_cfg.alpha, lora_dropout=adapter_cfg.dropout,
            target_modules=spec, use_dora=adapter_cfg.type == "dora",
            use_rslora=adapter_cfg.rslora, task_type=task,
            # Fused expert tensors: one rank-r pair per expert (PEFT's lora.ParamWrapper).
            target_parameters=parameters or None,
            # The router trains in full when asked (adapter.train_router); PEFT saves it with the adapter.
            modules_to_save=routers or None,
            init_lora_weights=peft_init(init),
        )
        plain_targets(model, spec, init)
        # PEFT reads each wrapped layer's weight only for its device and dtype, except DoRA (its norms)
        # and PiSSA / OLoRA (which factor it).
        values = adapter_cfg.type == "dora" or mutates_base(init)
        with weight_reads_without_values() if not values else contextlib.nullcontext():
            handle.model = model = get_peft_model(model, config)
        record_initial(model, init)
        if handle.autocast_dtype is not None and adapter_cfg.type != "qlora":
            store_frozen_linears_in(unwrap(model), handle.autocast_dtype)
        if getattr(adapter_cfg, "init_from", None):
            start_from(model, adapter_cfg.init_from)
        groups = adapter_groups(unwrap(model), layout, base_counts)
        warn_if_mostly_unadapted(groups)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # Frozen layers that keep their weight outside a parameter (4-bit, compact, streamed) count too.
    total = sum(p.numel() for p in model.parameters()) + sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, FrozenLinear) and not m.tied)
    return AdapterInfo(adapter_cfg.type, trainable, total, targets,
                       quantization if adapter_cfg.type == "qlora" else None, groups=groups)


def target_modules(model, wanted, layout=None) -> list[str]:
    """Leaf names of the linear layers to adapt; the output head is never a target
    (a new scalar head trains in full instead: PEFT's modules_to_save), nor a router
    that is a linear layer (adapter.train_router trains it in full)."""
    heads = {id(m) for m in (model.get_output_embeddings(), getattr(model, "score", None),
                             getattr(model, "classifier", None)) if m is not None}
    routers = set(layout.routers) if layout is not None else set()
    linear = {name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
              if isinstance(mod, torch.nn.Linear) and id(mod) not in heads and name not in routers}
    return choose_target_modules(linear, wanted, layout.target_names() if layout is not None else set())


def start_from(model, path: str) -> None:
    """adapter.init_from: the freshly attached adapter takes the weights stored at `path` (a PEFT adapter of
    the same kind, rank and modules: a previous curriculum stage's, from any backend)."""
    import json

    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    where = Path(path)
    if not (where / "adapter_model.safetensors").is_file():
        hint = (" (an mlx-lm adapter: convert it with `mudpuppy convert-adapter DIR OUT --to peft`)"
                if (where / "adapters.safetensors").is_file() else "")
        raise MudpuppyError(f"adapter.init_from {path}: no PEFT adapter there (adapter_model.safetensors){hint}")
    saved = json.loads((where / "adapter_config.json").read_text(encoding="utf-8"))
    mine = model.peft_config["default"]
    problems = []
    if saved.get("r") != mine.r or bool(saved.get("use_dora")) != bool(mine.use_dora):
        problems.append(f"it is {'dora' if saved.get('use_dora') else 'lora'} r={saved.get('r')}, this run attaches "
                        f"{'dora' if mine.use_dora else 'lora'} r={mine.r}")
    state = load_file(str(where / "adapter_model.safetensors"))
    expected = set(get_peft_model_state_dict(model))
    if set(state) != expected:
        diff = sorted(set(state) ^ expected)
        problems.append(f"{len(diff)} tensors differ between it and this run's adapter (e.g. {', '.join(diff[:2])})")
    if problems:
        raise MudpuppyError(f"adapter.init_from {path}: {'; '.join(problems)}; use the same adapter settings as "
                            "the run that wrote it")
    set_peft_model_state_dict(model, state)


def store_frozen_linears_in(model, dtype: torch.dtype) -> int:
    """Keep frozen linear weights in the autocast dtype; returns how many were converted.

    Autocast casts a weight to bf16 on every forward unless it is a trainable
    leaf (only those casts are cached), so a frozen fp32 base is re-cast in
    full each step. Matmuls see the same bf16 values either way; embeddings,
    norms and the output head stay as they are.
    """
    output = model.get_output_embeddings()
    converted = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, torch.nn.Linear) and module is not output and isinstance(weight, torch.nn.Parameter)
                and not weight.requires_grad and weight.dtype == torch.float32):
            module.weight.data = weight.data.to(dtype)
            if module.bias is not None and not module.bias.requires_grad:
                module.bias.data = module.bias.data.to(dtype)
            converted += 1
    return converted
