"""adapter.init on torch: PEFT's init_lora_weights, with PiSSA's and OLoRA's starting factors kept so the
saved adapter is a plain LoRA on the original base (adapters/init.py says why and how)."""

from __future__ import annotations

import re

import torch

from ....errors import MudpuppyError
from ...adapters.init import canonical_signs, mutates_base, rewrite_as_plain_lora
from .frozen import FrozenLinear, StoredLinear
from ..handle import unwrap

# Where the starting (A0, B0) of a PiSSA / OLoRA adapter live: on the PEFT model itself, so they go
# with it (a merge or a reload replaces the model, and with it this record).
INITIAL = "mudpuppy_lora_init"


def plain_targets(model, targets: list[str] | str, init: str) -> None:
    """PiSSA and OLoRA rewrite each target's weight, which must then be a float parameter: a target kept
    compact (a 16-bit checkpoint computed in fp32: frozen.py) becomes a plain linear at its compute dtype;
    one held 4-bit or streamed from host memory cannot take a residual, and is refused."""
    if not mutates_base(init):
        return
    held = []
    for name, mod in list(model.named_modules()):
        # PEFT's target_modules: leaf names, or one pattern over the full name (vision models: vision.py).
        targeted = re.fullmatch(targets, name) if isinstance(targets, str) else name.rsplit(".", 1)[-1] in targets
        if not targeted or not isinstance(mod, FrozenLinear):
            continue
        if not isinstance(mod, StoredLinear) or mod.streamed or mod.tied:
            held.append(name)
            continue
        plain = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None,
                                device=mod.compute_device, dtype=mod.weight_dtype)
        plain.weight = torch.nn.Parameter(mod.materialize(mod.weight_dtype), requires_grad=False)
        if mod.bias is not None:
            plain.bias = torch.nn.Parameter(mod.bias.detach().to(mod.weight_dtype), requires_grad=False)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, plain)
    if held:
        raise MudpuppyError(f"adapter.init {init}: {len(held)} target layers (e.g. {held[0]}) are held 4-bit or "
                            "streamed from host memory, and PiSSA / OLoRA replace each weight by a float "
                            "residual; turn memory.stream_layers off, or use adapter.init default")


def record_initial(model, init: str) -> None:
    """After PEFT's PiSSA / OLoRA: each component's sign made canonical (as MLX makes it), and the starting
    factors kept on the model for `save_plain`."""
    if not mutates_base(init):
        return
    from peft.tuners.lora import LoraLayer

    initial = {}
    for name, layer in unwrap(model).named_modules():
        if isinstance(layer, LoraLayer) and "default" in layer.lora_A:
            a_param, b_param = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            a, b = canonical_signs(a_param.detach().float().cpu().numpy(), b_param.detach().float().cpu().numpy())
            with torch.no_grad():
                a_param.copy_(torch.from_numpy(a))
                b_param.copy_(torch.from_numpy(b))
            initial[name] = (a, b)
    setattr(model, INITIAL, initial)


def save_plain(model, path: str) -> None:
    """The adapter PEFT just wrote at `path`, rewritten as a plain LoRA on the original base when it
    started from PiSSA / OLoRA; any other adapter is left as written."""
    initial = getattr(model, INITIAL, None)
    if initial:
        rewrite_as_plain_lora(path, initial)
