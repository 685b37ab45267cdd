"""adapter.init eva on torch: PEFT's EVA (get_eva_state_dict) over the run's training batches, attached as
one plain LoRA at the largest rank EVA gives a layer (adapters/eva.py says why, and why it trains the same)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ....errors import MudpuppyError
from ...adapters.eva import eva_attached, eva_labels, uniform_rank
from ...protocol import AdapterInfo
from ..handle import unwrap
from .attach import attach_adapter

PREFIX = "base_model.model."       # PEFT's names of the wrapped model's modules


def attach_eva(backend, handle, adapter_cfg, batches) -> AdapterInfo:
    """EVA's A (B zero) on a LoRA of rank R = max r_i, alpha scaled to keep alpha / r; what attach_adapter
    returns."""
    components = eva_components(backend, handle, adapter_cfg, batches)
    rank, alpha, padded = uniform_rank(components, adapter_cfg.r, adapter_cfg.alpha)
    info = attach_adapter(backend, handle, eva_attached(adapter_cfg, rank, alpha))
    set_eva_factors(handle.model, padded)
    return info


def eva_components(backend, handle, adapter_cfg, batches) -> dict[str, np.ndarray]:
    """{layer: A_i [r_i, in]} of PEFT's EVA over `batches` (data.Batch), with the LoRA it needed taken off
    again: the model is as it was loaded."""
    from peft import EvaConfig, LoraConfig
    from peft.tuners.lora.eva import get_eva_state_dict

    if not batches:
        raise MudpuppyError("adapter.init eva computes A from the training batches of an SFT run (mudpuppy run "
                            "passes them), and none were given here; `mudpuppy parity` does not compute EVA: "
                            "compare with adapter.init default")
    attach_adapter(backend, handle, adapter_cfg.model_copy(update={"init": "default", "eva_rho": None}))
    model = handle.model
    config = LoraConfig(r=adapter_cfg.r, lora_alpha=adapter_cfg.alpha, init_lora_weights="eva",
                        target_modules=model.peft_config["default"].target_modules,
                        eva_config=EvaConfig(rho=adapter_cfg.rho))
    device = next(model.parameters()).device
    inputs = [eva_inputs(batch, device) for batch in batches]
    dtype = handle.autocast_dtype

    def forward(model, batch):
        with (torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()):
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])

    try:
        state = get_eva_state_dict(model, inputs, config, forward_fn=forward, show_progress_bar=False)
    except ValueError as exc:
        raise MudpuppyError(f"adapter.init eva: PEFT's EVA failed on this run's batches ({exc}); with few or "
                            "short examples lower adapter.r or eva_rho") from exc
    finally:
        handle.model = model.unload()
    return {name.removeprefix(PREFIX): a.detach().to("cpu", torch.float32).numpy() for name, a in state.items()}


def eva_inputs(batch, device) -> dict[str, torch.Tensor]:
    """One batch as EVA's model inputs, its labels aligned as transformers aligns them."""
    return {"input_ids": torch.as_tensor(batch.input_ids, device=device),
            "attention_mask": torch.as_tensor(batch.attention_mask, device=device),
            "labels": torch.as_tensor(eva_labels(batch.labels), device=device)}


def set_eva_factors(model, padded: dict[str, np.ndarray]) -> None:
    from peft.tuners.lora import LoraLayer

    layers = {name: layer for name, layer in unwrap(model).named_modules()
              if isinstance(layer, LoraLayer) and "default" in layer.lora_A}
    if set(layers) != set(padded):
        raise MudpuppyError(f"adapter.init eva: EVA initialised {len(padded)} layers, the adapter has {len(layers)}")
    with torch.no_grad():
        for name, layer in layers.items():
            a = layer.lora_A["default"].weight
            a.copy_(torch.from_numpy(padded[name]).to(a.device, a.dtype))
            layer.lora_B["default"].weight.zero_()


def eva_components_of(source: str, adapter_cfg, batches) -> dict[str, np.ndarray]:
    """EVA's components on the checkpoint at `source`, computed on this machine's CPU in fp32: what another
    runtime (MLX) starts from, carried as arrays."""
    from ...factory import create_backend
    from ....config import ModelConfig

    backend = create_backend("cpu")
    handle = backend.load_model(ModelConfig(base_model=source), "fp32")
    return eva_components(backend, handle, adapter_cfg, batches)
