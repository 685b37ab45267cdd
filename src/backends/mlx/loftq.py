"""adapter.init loftq on MLX: QLoRA's adapter on MLX's own 4-bit base (mx.quantize), each layer's A, B from
the SVD of that base's quantization error (adapters/init.py `loftq_factors`). Not carried from torch as EVA's
A is: the two runtimes quantize differently (torch's int4 is mudpuppy's min-max groups, MLX's its affine
mode; even their MXFP4 rounding may differ), so each corrects its own error, and an adapter started on one
base is LoftQ's start only on that base. adapter.loftq_iter > 1 runs the same iterations as torch
(`loftq_iterated`) with mx.quantize: each layer's codes are replaced by those of the last iteration."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn

from ...errors import MudpuppyError
from ..adapters.init import loftq_iterated
from .families import config_overrides, model_classes
from .layers import adapter_layers, base_weight


def attach_loftq(backend, handle, adapter_cfg):
    """What attach_adapter returns for the QLoRA adapter, its A, B replaced by LoftQ's on every 4-bit
    target (a target MLX kept at full precision, its width not a multiple of the group, keeps the default
    start, as PEFT leaves a layer that is not 4-bit)."""
    info = backend.attach_adapter(handle, adapter_cfg.model_copy(update={"init": "default"}))
    # `mudpuppy parity`'s second side starts from the first side's A, B (init_from): only the base that
    # more than one iteration leaves is rebuilt under them.
    if adapter_cfg.init_from and adapter_cfg.loftq_iter == 1:
        return info
    layers = {path: layer for path, layer in adapter_layers(handle.model).items()
              if isinstance(layer.linear, nn.QuantizedLinear)}
    if not layers:
        raise MudpuppyError("adapter.init loftq: no target of the adapter is a 4-bit linear layer on MLX (a "
                            "width not a multiple of the group stays full precision); check adapter.target_modules")
    original = full_precision_linears(handle.source)
    missing = sorted(set(layers) - set(original))
    if missing:
        raise MudpuppyError(f"adapter.init loftq: the checkpoint at {handle.source} has no linear layer "
                            f"{missing[0]} (and {len(missing) - 1} more targets) to read at full precision")
    for path, layer in layers.items():
        weight = np.array(original[path].weight.astype(mx.float32))
        dequantized = np.array(base_weight(layer.linear).astype(mx.float32))
        a, b = loftq_iterated(weight, dequantized, requantizer(layer.linear), layer.lora_a.shape[1], layer.scale,
                              adapter_cfg.loftq_iter)
        if adapter_cfg.init_from:
            continue
        layer.lora_a = mx.array(a.T).astype(layer.lora_a.dtype)
        layer.lora_b = mx.array(b.T).astype(layer.lora_b.dtype)
    mx.eval(handle.model.parameters())
    return info


def requantizer(linear: nn.QuantizedLinear):
    """x -> dequantize(quantize(x)) in `linear`'s format, its codes replaced by Q(x) (x quantized in the
    dtype of the affine scales, as the loaded weight was; MXFP4's byte exponents come from fp32)."""
    floats = (mx.float32, mx.float16, mx.bfloat16)
    dtype = linear.scales.dtype if linear.scales.dtype in floats else mx.float32

    def requantize(x):
        packed = mx.quantize(mx.array(x).astype(dtype), group_size=linear.group_size, bits=linear.bits, mode=linear.mode)
        linear.weight, linear.scales = packed[0], packed[1]
        if len(packed) > 2 and packed[2] is not None:
            linear.biases = packed[2]
        return np.array(base_weight(linear).astype(mx.float32))
    return requantize


def full_precision_linears(source: str) -> dict[str, nn.Module]:
    """Path -> linear layer of the checkpoint loaded again lazily, unquantized: a weight is read only when
    one layer's is evaluated, so at most a layer's full-precision weight exists at a time."""
    from mlx_lm.utils import load_model as mlx_load_model

    raw = json.loads((Path(source) / "config.json").read_text())
    remote = ({"trust_remote_code": False}
              if "trust_remote_code" in inspect.signature(mlx_load_model).parameters else {})
    model, _ = mlx_load_model(Path(source), lazy=True, model_config=config_overrides(raw),
                              get_model_classes=model_classes, **remote)
    return {name: mod for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}
