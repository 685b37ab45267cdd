"""adapter.init eva on MLX: EVA's A computed once by PEFT on torch (CPU, fp32) from the same checkpoint and
batches, carried here as arrays and attached as the same one-rank plain LoRA (adapters/eva.py)."""

from __future__ import annotations

import mlx.core as mx

from ...errors import MudpuppyError
from ..adapters.eva import eva_attached, uniform_rank
from .layers import adapter_layers


def attach_eva(backend, handle, adapter_cfg, batches):
    """What attach_adapter returns, the adapter starting from EVA's A (B zero)."""
    from ..torch.model.eva import eva_components_of

    if handle.quantization is not None:
        raise MudpuppyError("adapter.init eva: this model's base is quantized, and EVA decomposes the inputs of "
                            "the unquantized layers; load an unquantized base")
    components = eva_components_of(handle.source, adapter_cfg, batches)
    rank, alpha, padded = uniform_rank(components, adapter_cfg.r, adapter_cfg.alpha)
    info = backend.attach_adapter(handle, eva_attached(adapter_cfg, rank, alpha))
    layers = adapter_layers(handle.model)
    if set(layers) != set(padded):
        raise MudpuppyError(f"adapter.init eva: EVA initialised {len(padded)} layers on torch, the MLX adapter "
                            f"has {len(layers)} (e.g. {', '.join(sorted(set(layers) ^ set(padded))[:2])})")
    for path, layer in layers.items():
        layer.lora_a = mx.array(padded[path].T).astype(layer.lora_a.dtype)
        layer.lora_b = mx.zeros_like(layer.lora_b)
    mx.eval(handle.model.parameters())
    return info
