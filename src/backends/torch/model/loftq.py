"""adapter.init loftq on torch: QLoRA's adapter attached as usual on mudpuppy's own 4-bit base, then each
layer's A, B set from the SVD of its quantization error (adapters/init.py `loftq_factors`, PEFT's
`replace_lora_weights_loftq` without bitsandbytes). The full-precision weights are read again from the
checkpoint, one tensor at a time, as PEFT's reads them from the model's safetensors: the 4-bit base was
built while loading and keeps no float copy. With adapter.loftq_iter > 1 (PEFT's `loftq_init`), each
layer's 4-bit codes are rewritten in place by the iterations (adapters/init.py `loftq_iterated`): the
same computation again on resume gives the same base, before the trained A, B are loaded."""

from __future__ import annotations

from pathlib import Path

import torch

from ....errors import MudpuppyError
from ...adapters.init import loftq_iterated
from ..quantization.formats import quantize_weight
from ...protocol import AdapterInfo
from ..handle import unwrap
from ..quantization.linear4bit import Linear4bit
from .attach import attach_adapter
from .loading import checkpoint_files, read_entry, read_header


def attach_loftq(backend, handle, adapter_cfg) -> AdapterInfo:
    """The QLoRA adapter attach_adapter gives, its A, B replaced by LoftQ's; what attach_adapter returns."""
    info = attach_adapter(backend, handle, adapter_cfg.model_copy(update={"init": "default"}))
    # `mudpuppy parity`'s second side starts from the first side's A, B (init_from): only the base that
    # more than one iteration leaves is rebuilt under them.
    if not adapter_cfg.init_from or adapter_cfg.loftq_iter > 1:
        set_loftq_factors(handle, Path(handle.source), adapter_cfg, keep_factors=bool(adapter_cfg.init_from))
    return info


def quantized_lora_layers(model) -> dict[str, object]:
    """Module name -> PEFT LoRA layer over a 4-bit base. As in PEFT, a target of another kind (a fused
    expert stack, a layer kept in full precision) keeps the default start; none at all is refused."""
    from peft.tuners.lora import LoraLayer

    layers = {name: layer for name, layer in unwrap(model).named_modules()
              if isinstance(layer, LoraLayer) and "default" in layer.lora_A
              and isinstance(layer.get_base_layer(), Linear4bit)}
    if not layers:
        raise MudpuppyError("adapter.init loftq: no target of the adapter is a 4-bit linear layer, and LoftQ "
                            "corrects a 4-bit weight; check adapter.target_modules")
    return layers


def requantizer(base: Linear4bit, group_size: int | None):
    """x -> dequantize(quantize(x)) in `base`'s format, its codes overwritten in place by Q(x)."""
    def requantize(x):
        tensors = quantize_weight(torch.from_numpy(x), base.quant_backend, group_size)
        for name, stored in base.quantized_tensors().items():
            stored.copy_(tensors[name].to(stored.device, stored.dtype))
        return base.dequantize(torch.float32).cpu().numpy()
    return requantize


def set_loftq_factors(handle, source: Path, adapter_cfg, keep_factors: bool = False) -> None:
    files = checkpoint_files(source)
    if files is None:
        raise MudpuppyError(f"adapter.init loftq reads each weight at full precision from the checkpoint's "
                            f"safetensors files, and {source} has none")
    entries = {}
    for path in files:
        entries.update(read_header(path))
    layers = quantized_lora_layers(handle.model)
    missing = sorted(name for name in layers if f"{name}.weight" not in entries)
    if missing:
        raise MudpuppyError(f"adapter.init loftq: {source} has no tensor {missing[0]}.weight (and {len(missing) - 1} "
                            "more targets), so their full-precision weights cannot be read")
    with torch.no_grad():
        for name, layer in layers.items():
            weight = read_entry(entries[f"{name}.weight"]).to(torch.float32)
            dequantized = layer.get_base_layer().dequantize(torch.float32).cpu()
            a, b = loftq_iterated(weight.numpy(), dequantized.numpy(),
                                  requantizer(layer.get_base_layer(), adapter_cfg.quant_group_size),
                                  layer.r["default"], layer.scaling["default"], adapter_cfg.loftq_iter)
            if keep_factors:
                continue
            for param, value in ((layer.lora_A["default"].weight, a), (layer.lora_B["default"].weight, b)):
                param.copy_(torch.from_numpy(value).to(param.device, param.dtype))
