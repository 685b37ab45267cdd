"""Quantization-aware training's layers on torch: torchao's fake quantization while training, our
kernels after.

    prepare_qat(model, spec)    every linear layer but the output head computes with fake-quantized
                                weights (and, with activations int8, inputs): torchao's
                                QATConfig(step="prepare") swaps the plain nn.Linear layers for its
                                FakeQuantizedLinear; LoRA layers fake-quantize their merged weight
                                (below) with torchao's own IntxFakeQuantizer
    set_fake_quant(model, on)   switch every fake quantizer on or off (fake_quant_after_n_steps)
    convert_qat(model, layers)  torchao's QATConfig(step="convert") swaps its layers back, then each
                                layer becomes a `quantized_linear.QuantizedLinear` holding int8 codes
                                (of 4 or 8 bits) and float32 group scales: the same grid the fake
                                quantizer used, so the converted model computes what training saw

The converted model's files are files.py; the backend's `method: qat` (protocol.QatPlan) is method.py.

LoRA: the deployed model is the base with the adapter merged in, then quantized, so
that is what training fakes: each LoRA layer computes ``x @ fq(W + scale * B A)^T + b``
(the delta in float32, autocast off, exactly as the conversion merges it), and the
straight-through estimator passes the gradient on to A and B. Fake-quantizing only
the base would train the adapter for a model that is never shipped. PEFT's adapter
dropout acts on the adapter's input alone and has no merged-weight form, so QAT with
LoRA needs adapter.dropout 0; DoRA and QLoRA are refused.

"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .....errors import MudpuppyError
from ...model.frozen import FrozenLinear
from ..quantized_linear import QuantizedLinear

QUANT_METHOD = "mudpuppy_qat"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class QatSpec:
    """What to fake and convert to: symmetric per-group weights, optionally int8 per-token activations."""

    weight_bits: int = 4
    group_size: int = 32              # -1: one scale per output row
    activations: str = "none"         # "none" or "int8"

    @classmethod
    def from_config(cls, qat_cfg) -> "QatSpec":
        return cls(qat_cfg.weight_bits, qat_cfg.group_size, qat_cfg.activations)

    def weight_fake_config(self):
        from torchao.quantization.qat import IntxFakeQuantizeConfig

        dtype = {4: torch.int4, 8: torch.int8}[self.weight_bits]
        if self.group_size == -1:
            return IntxFakeQuantizeConfig(dtype, "per_channel", is_symmetric=True)
        return IntxFakeQuantizeConfig(dtype, group_size=self.group_size, is_symmetric=True)

    def activation_fake_config(self):
        from torchao.quantization.qat import IntxFakeQuantizeConfig

        if self.activations == "none":
            return None
        return IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)

    def describe(self) -> str:
        groups = "one scale per output row" if self.group_size == -1 else f"groups of {self.group_size}"
        acts = ", int8 dynamic per-token activations" if self.activations == "int8" else ""
        return f"int{self.weight_bits} weights ({groups}, symmetric){acts}"

    def quantization_config(self, modules: list[str]) -> dict:
        return {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION, "weight_bits": self.weight_bits,
                "group_size": self.group_size, "symmetric": True, "activations": self.activations,
                "modules": list(modules)}


@dataclass
class QatLayers:
    """The layers prepare_qat made fake-quantize, by how."""

    spec: QatSpec
    swapped: list[str] = field(default_factory=list)    # torchao FakeQuantizedLinear (plain nn.Linear before)
    merged: list[str] = field(default_factory=list)     # LoRA layers: fake quantization of base + adapter
    frozen: list[str] = field(default_factory=list)     # frozen layers keeping their weight outside a parameter

    def names(self) -> list[str]:
        return sorted(self.swapped + self.merged + self.frozen)

    def describe(self) -> str:
        parts = [f"{len(self.swapped)} through torchao's FakeQuantizedLinear"] if self.swapped else []
        if self.merged:
            parts.append(f"{len(self.merged)} LoRA layers on their merged weight")
        if self.frozen:
            parts.append(f"{len(self.frozen)} frozen")
        return f"{self.spec.describe()}; {len(self.names())} linear layers fake-quantized ({', '.join(parts)})"


# --------------------------------------------------------------------------- checks before anything loads


def check_adapter(adapter_cfg) -> None:
    """QAT trains in full or with plain LoRA (see the module docstring)."""
    kind = adapter_cfg.type
    if kind in ("dora", "qlora"):
        raise MudpuppyError(f"adapter.type {kind}: method qat fake-quantizes the weights the deployed model will "
                            "have (the base, or the base with a LoRA merged in); use adapter.type lora or none")
    if kind == "lora" and adapter_cfg.dropout:
        raise MudpuppyError(f"adapter.dropout {adapter_cfg.dropout}: with method qat a LoRA layer computes with "
                            "its merged, fake-quantized weight, which has no place for dropout on the adapter's "
                            "input alone; set adapter.dropout: 0")


def check_group_size(model_path: str | Path, spec: QatSpec, trust_remote_code: bool = False) -> int:
    """Refuse a group size that does not divide every quantized layer's input width, from the model's
    config alone (the model is built on the meta device). Returns the number of layers to quantize."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    layers = [(name, m.in_features) for name, m in _plain_linears(model)]
    if not layers:
        raise MudpuppyError(f"method qat: {model_path} has no linear layers to quantize besides its output head")
    if spec.group_size == -1:
        return len(layers)
    bad = [(name, width) for name, width in layers if width % spec.group_size]
    if bad:
        widths = sorted({width for _, width in layers})
        common = math.gcd(*widths)
        largest = common & -common        # the largest power of two dividing every width
        example = ", ".join(f"{name} ({width} inputs)" for name, width in bad[:2])
        raise MudpuppyError(
            f"qat.group_size: {spec.group_size} does not divide the input width of {len(bad)} of the {len(layers)} "
            f"layers to quantize, e.g. {example}; input widths here are {', '.join(map(str, widths))}, so use a "
            f"power of two up to {largest}, or -1 for one scale per output row")
    return len(layers)


def _plain_linears(model: nn.Module):
    """(name, module) of each linear layer to quantize in a transformers model: all but the output head."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not output]


# --------------------------------------------------------------------------- prepare / switch / convert


def _unwrap(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def prepare_qat(model: nn.Module, spec: QatSpec) -> QatLayers:
    """Make every linear layer but the output head fake-quantize, in place; fake quantization starts off
    (`set_fake_quant` turns it on). Works on a transformers model or a PEFT model around one."""
    from peft.tuners.lora import LoraLayer
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    base = _unwrap(model)
    output = base.get_output_embeddings()
    layers = QatLayers(spec)
    lora = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    for name, module in lora.items():
        if not hasattr(module, "get_delta_weight") or not isinstance(module.get_base_layer(), nn.Linear):
            raise MudpuppyError(f"method qat: {name} is a {type(module).__name__}, which QAT cannot merge; "
                                "use LoRA on linear layers only")
        _fake_quantize_forward(module, spec, lora_merged_weight, lambda m: m.get_base_layer().bias)
        layers.merged.append(name)
    inside_lora = tuple(f"{name}." for name in lora)
    for name, module in base.named_modules():
        if not isinstance(module, nn.Linear) or module is output or name.startswith(inside_lora) or name in lora:
            continue
        if isinstance(module, FrozenLinear):
            _fake_quantize_forward(module, spec, lambda m: m.weight, lambda m: m.bias)
            layers.frozen.append(name)
        else:
            layers.swapped.append(name)
    _check_widths(base, layers)
    swap = set(layers.swapped)
    if swap:
        config = QATConfig(activation_config=spec.activation_fake_config(), weight_config=spec.weight_fake_config(),
                           step="prepare")
        quantize_(base, config, filter_fn=lambda m, fqn: fqn in swap and isinstance(m, nn.Linear))
    set_fake_quant(model, False)
    return layers


def _check_widths(base: nn.Module, layers: QatLayers) -> None:
    if layers.spec.group_size == -1:
        return
    for name in layers.names():
        width = _in_features(base.get_submodule(name))
        if width % layers.spec.group_size:
            raise MudpuppyError(f"qat.group_size: {layers.spec.group_size} does not divide the input width of {name} "
                                f"({width}); use a divisor of it, or -1 for one scale per output row")


def _in_features(module: nn.Module) -> int:
    return module.get_base_layer().in_features if hasattr(module, "get_base_layer") else module.in_features


def lora_merged_weight(layer) -> torch.Tensor:
    """A PEFT LoRA layer's base weight plus its active adapters' deltas, in float32 with autocast off:
    what `convert_qat` quantizes, computed the same way while training (where gradients reach A and B)."""
    weight = layer.get_base_layer().weight
    with torch.autocast(weight.device.type, enabled=False):
        weight = weight.float()
        if not layer.disable_adapters:
            for name in layer.active_adapters:
                if name in layer.lora_A:
                    weight = weight + layer.get_delta_weight(name).float()
    return weight


def _fake_quantize_forward(module: nn.Module, spec: QatSpec, weight_of, bias_of) -> None:
    """Give `module` torchao fake quantizers and a forward computing with them while they are on, and its
    own forward while they are off (so a run before fake quantization starts is plain SFT to the last
    bit). The module, its parameters and their names stay as they are: PEFT saves the adapter as usual."""
    from torchao.quantization.qat import FakeQuantizerBase

    module.qat_weight_fake_quantizer = FakeQuantizerBase.from_config(spec.weight_fake_config())
    act = spec.activation_fake_config()
    module.qat_activation_fake_quantizer = FakeQuantizerBase.from_config(act) if act is not None else None
    original = module.forward

    def forward(x, *args, **kwargs):
        if not module.qat_weight_fake_quantizer.enabled:
            return original(x, *args, **kwargs)      # switched off: exactly the layer's own computation
        weight = module.qat_weight_fake_quantizer(weight_of(module))
        if module.qat_activation_fake_quantizer is not None:
            x = module.qat_activation_fake_quantizer(x)
        if weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            weight = weight.to(x.dtype)
        bias = bias_of(module)
        return F.linear(x, weight, None if bias is None else bias.to(weight.dtype))

    module.forward = forward


def set_fake_quant(model: nn.Module, enabled: bool) -> None:
    """Switch fake quantization on or off everywhere: torchao's own helper for its FakeQuantizedLinear
    layers, and the same `enabled` flag on the quantizers `prepare_qat` gave LoRA and frozen layers."""
    from torchao.quantization.qat import FakeQuantizerBase
    from torchao.quantization.qat.linear import enable_linear_fake_quant

    model.apply(lambda m: enable_linear_fake_quant(m, enabled))
    for module in model.modules():
        if isinstance(module, FakeQuantizerBase):
            module.enabled = enabled


@torch.no_grad()
def convert_qat(model: nn.Module, layers: QatLayers) -> nn.Module:
    """The transformers model with each prepared layer replaced by a `QuantizedLinear` (LoRA merged first);
    returns it (unwrapped from PEFT). Its config carries the quantization_config `save_quantized` writes."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import FakeQuantizedLinear, QATConfig

    base = _unwrap(model)
    quantize_(base, QATConfig(step="convert"), filter_fn=lambda m, fqn: isinstance(m, FakeQuantizedLinear))
    spec = layers.spec
    merged = set(layers.merged)
    for name in layers.names():
        module = base.get_submodule(name)
        if name in merged:
            weight, bias = lora_merged_weight(module), module.get_base_layer().bias
        else:
            weight, bias = module.weight, module.bias
        base.set_submodule(name, QuantizedLinear.from_weight(weight.detach(), bias, spec.weight_bits, spec.group_size,
                                                             spec.activations))
    base.config.quantization_config = spec.quantization_config(layers.names())
    return base
