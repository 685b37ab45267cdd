"""LoRA and DoRA layers for MLX that compute exactly what PEFT computes.

mlx-lm's own layers are close but not the same: with dropout on, its DoRA
rescales the base output of the undropped input, where PEFT's correction
term (m/n - 1) * W dropout(x) uses the dropped-out one. These follow PEFT's
formulas term by term, so an adapter trains and runs the same on either
runtime. Parameter names and shapes are mlx-lm's (``lora_a`` [in, r],
``lora_b`` [r, out], ``m`` [out]), so the saved weights load with
``mlx_lm.utils.load_adapters`` as they are.

Each layer wraps a plain or quantized linear (QLoRA) and shares one small
shape: ``from_base``, ``__call__``, ``fused``.
"""

from __future__ import annotations

import contextlib
import math

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_unflatten

ADAPTER_PARAMS = ("lora_a", "lora_b", "m")
HEAD_LEAVES = ("lm_head", "score")   # output heads: never adapted (a scalar head trains in full instead)


def base_weight(linear: nn.Module) -> mx.array:
    """The [out, in] weight of a plain or quantized linear, dequantized when needed."""
    if isinstance(linear, nn.QuantizedLinear):
        return mx.dequantize(linear.weight, linear.scales, linear.get("biases"), group_size=linear.group_size,
                             bits=linear.bits, mode=linear.mode)
    return linear.weight


def linear_dims(linear: nn.Module) -> tuple[int, int]:
    out_dims, in_dims = linear.weight.shape
    if isinstance(linear, nn.QuantizedLinear):
        in_dims = in_dims * 32 // linear.bits  # packed: 32 // bits values per uint32
    return in_dims, out_dims


class LoRALinear(nn.Module):
    """PEFT LoRA: base(x) + B(A(dropout(x))) * scale, with A kaiming-uniform and B zero at the start."""

    @classmethod
    def from_base(cls, linear: nn.Module, r: int, scale: float, dropout: float = 0.0):
        return cls(linear, r, scale, dropout)

    def __init__(self, linear: nn.Module, r: int, scale: float, dropout: float = 0.0):
        super().__init__()
        in_dims, out_dims = linear_dims(linear)
        self.linear = linear
        self.linear.freeze()
        self.scale = scale
        self.dropout = nn.Dropout(p=dropout) if dropout > 0 else None
        # PEFT: kaiming_uniform_(a=sqrt(5)) on an [r, in] weight, i.e. U(-1/sqrt(in), 1/sqrt(in)).
        bound = 1.0 / math.sqrt(in_dims)
        self.lora_a = mx.random.uniform(low=-bound, high=bound, shape=(in_dims, r))
        self.lora_b = mx.zeros((r, out_dims))
        self.enabled = True  # off: the base layer alone (the reference model of DPO and KTO)

    def low_rank(self, x: mx.array) -> mx.array:
        return (x @ self.lora_a) @ self.lora_b

    def dropped(self, x: mx.array) -> mx.array:
        return self.dropout(x) if self.dropout is not None else x

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        if not self.enabled:
            return y
        return y + (self.low_rank(self.dropped(x)) * self.scale).astype(y.dtype)

    def delta_weight(self) -> mx.array:
        """scale * B @ A in PEFT's [out, in] orientation."""
        return self.scale * (self.lora_b.T @ self.lora_a.T)

    def merged_weight(self) -> mx.array:
        return base_weight(self.linear).astype(mx.float32) + self.delta_weight()

    def fused(self) -> nn.Linear:
        """A plain linear computing what this layer computes (a quantized base comes back dequantized)."""
        return plain_linear(self.merged_weight(), self.linear)


class DoRALinear(LoRALinear):
    """PEFT DoRA: the LoRA-updated weight's rows renormalised to a learned magnitude m.

    out = base(x) + (m/n - 1) * (x W^T) + (m/n) * scale * B(A(x)),  n = ||W + scale*BA||_row,
    with n detached from the gradient (DoRA paper, section 4.3, as PEFT does). With
    dropout active PEFT feeds dropout(x) to both correction terms, and so does this.
    """

    def __init__(self, linear: nn.Module, r: int, scale: float, dropout: float = 0.0):
        super().__init__(linear, r, scale, dropout)
        # B = 0 at the start, so n = |W| and m = n: the layer starts as the base layer.
        self.m = mx.linalg.norm(base_weight(linear).astype(mx.float32), axis=1)

    def merged_weight(self) -> mx.array:
        """PEFT's merge: the updated weight's rows rescaled to the magnitude m."""
        updated = super().merged_weight()
        return (self.m / mx.linalg.norm(updated, axis=1))[:, None] * updated

    def __call__(self, x: mx.array) -> mx.array:
        if not self.enabled:
            return self.linear(x)
        weight = base_weight(self.linear)
        y = self.linear(x)
        norm = mx.stop_gradient(mx.linalg.norm(weight.astype(mx.float32) + self.delta_weight(), axis=1))
        ratio = (self.m / norm).astype(y.dtype)
        dropping = self.dropout is not None and self.training
        if dropping:
            x = self.dropout(x)
            base_out = x @ weight.T
        else:
            base_out = y - self.linear["bias"] if "bias" in self.linear else y
        lora = (self.low_rank(x) * self.scale).astype(y.dtype)
        return y + (ratio - 1) * base_out + ratio * lora


def adapter_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Module path -> adapter layer, for every LoRA or DoRA layer in the model."""
    return {name: mod for name, mod in model.named_modules() if isinstance(mod, LoRALinear)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base model for the duration (PEFT's disable_adapter); a model without adapters is itself."""
    from .experts import expert_adapters

    layers = list(adapter_layers(model).values()) + list(expert_adapters(model).values())
    for layer in layers:
        layer.enabled = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.enabled = True


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Module path -> plain or quantized linear, without the output heads (never targets, as in PEFT)."""
    return {name: mod for name, mod in model.named_modules()
            if isinstance(mod, (nn.Linear, nn.QuantizedLinear)) and name.rsplit(".", 1)[-1] not in HEAD_LEAVES}


def wrap_linears(model: nn.Module, paths: list[str], kind: str, r: int, scale: float, dropout: float) -> None:
    """Replace each linear at `paths` by a LoRA (or DoRA) layer around it; only adapters stay trainable."""
    modules = dict(model.named_modules())
    layer = DoRALinear if kind == "dora" else LoRALinear
    model.freeze()
    wrapped = [(path, layer.from_base(modules[path], r, scale, dropout)) for path in paths]
    model.update_modules(tree_unflatten(wrapped))
    for _, mod in wrapped:
        mod.unfreeze(keys=[k for k in ADAPTER_PARAMS if k in mod], recurse=False)


def plain_linear(weight: mx.array, like: nn.Module) -> nn.Linear:
    out_dims, in_dims = weight.shape
    bias = "bias" in like
    linear = nn.Linear(in_dims, out_dims, bias=bias)
    dtype = like.scales.dtype if isinstance(like, nn.QuantizedLinear) else like.weight.dtype
    linear.weight = weight.astype(dtype)
    if bias:
        linear.bias = like.bias
    return linear


def merge_adapters(model: nn.Module) -> None:
    """Fold every adapter into its base weight and dequantize what is left quantized, in place.

    The result is a plain model that transformers can load; a model with no
    adapter and no quantized layer is left as it is, so merging twice is a no-op.
    """
    from .experts import expert_adapters

    replaced = [(name, mod.fused()) for name, mod in {**adapter_layers(model), **expert_adapters(model)}.items()]
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    quantized = [(name, plain_linear(base_weight(mod), mod)) for name, mod in model.named_modules()
                 if isinstance(mod, nn.QuantizedLinear)]
    if quantized:
        model.update_modules(tree_unflatten(quantized))
