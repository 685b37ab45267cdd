"""QLoRA base layers without bitsandbytes: `Linear4bit` and whole-model quantization.

`quantize_model` swaps every plain ``nn.Linear`` (except the output head and
anything named in `skip_modules`) for a frozen `Linear4bit` that keeps only
packed 4-bit codes and their scales (formats in `quant_formats`). The
full-precision weight is rebuilt on the fly in each forward pass, and again in
backward, in the input's dtype (or the autocast dtype).

`Linear4bit` subclasses ``nn.Linear`` because PEFT only wraps layers that pass
``isinstance(layer, nn.Linear)``. Its ``weight`` is a read-only property:
readers such as DoRA's weight norm get the dequantized values, while PEFT's
in-place merge (``base_layer.weight.data += delta``) raises instead of
silently editing a temporary copy. To merge an adapter, call
`dequantize_model` first: it turns each `Linear4bit` back into an ``nn.Linear``
holding exactly the weights the adapter was trained against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import MudpuppyError
from .quant_formats import (
    MX_BLOCK,
    check_group_size,
    check_quant_backend,
    dequantize_weight,
    quantize_weight,
)

BF16_BYTES = 2

MERGE_HINT = (
    "Linear4bit keeps its weight as 4-bit codes; `.weight` is a read-only copy rebuilt on each read, so "
    "writing to it (as PEFT's merge does) would change nothing. Call "
    "mudpuppy.backends.torch.quantize.dequantize_model(model) first: it swaps every Linear4bit for an "
    "nn.Linear holding the dequantized weight, and the adapter then merges normally."
)


class DequantizedWeight(torch.Tensor):
    """A read-only full-precision copy of a `Linear4bit` weight.

    Every operation runs as on a plain tensor and returns plain tensors; writes
    (in-place methods, item or ``.data`` assignment) raise, because they would
    only ever modify this temporary. ``.data`` reads stay guarded, so PEFT's
    ``weight.data += delta`` raises too.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if is_tensor_write(func):
            raise MudpuppyError(MERGE_HINT)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
        if is_data_access(func):
            return result.as_subclass(cls)
        return result


def is_data_access(func) -> bool:
    """Whether `func` is the getter or setter of ``Tensor.data``."""
    return getattr(func, "__self__", None) is torch.Tensor.data


def is_tensor_write(func) -> bool:
    """Whether a torch function would write into its first tensor argument."""
    name = getattr(func, "__name__", "")
    if name == "__set__":
        return is_data_access(func)
    if name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"):
        return True
    return name.endswith("_") and not name.startswith("_") and name != "requires_grad_"


class DequantizeLinear(torch.autograd.Function):
    """``x @ W.T + b`` with W rebuilt from 4 bits in forward and again in backward.

    Saving the rebuilt W for backward, as ``F.linear`` would, keeps a
    full-precision copy of every layer alive from forward to backward: the very
    memory QLoRA exists to save.
    """

    @staticmethod
    def forward(ctx, x, layer, bias):
        ctx.layer = layer
        return F.linear(x, layer.dequantize(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_output):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_output @ ctx.layer.dequantize(grad_output.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
        return grad_x, None, grad_bias


def choose_compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for x's device, else x's own dtype."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class Linear4bit(nn.Linear):
    """A frozen linear layer stored as 4-bit codes (int4 or MXFP4), dequantized on the fly.

    Buffers: ``qweight`` (uint8, two codes a byte) and ``scales`` + ``mins``
    (int4) or ``exponents`` (MXFP4). No full-size weight exists between calls.
    """

    def __init__(self, in_features: int, out_features: int, quant_backend: str,
                 tensors: dict[str, torch.Tensor], bias: torch.Tensor | None = None,
                 weight_dtype: torch.dtype = torch.float32):
        # Skip nn.Linear.__init__: it would allocate the full-precision weight we are avoiding.
        nn.Module.__init__(self)
        check_quant_backend(quant_backend)
        self.in_features, self.out_features = in_features, out_features
        self.quant_backend = quant_backend
        self.weight_dtype = weight_dtype
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)
        bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_parameter("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, quant_backend: str = "int4", group_size: int | None = 64) -> Linear4bit:
        with torch.no_grad():
            tensors = quantize_weight(linear.weight.detach(), quant_backend, group_size)
        return cls(linear.in_features, linear.out_features, quant_backend, tensors, linear.bias,
                   weight_dtype=linear.weight.dtype)

    @property
    def group_size(self) -> int:
        """Inputs sharing one scale: the int4 group (the row when per-row) or the MX block."""
        if self.quant_backend == "mxfp4":
            return MX_BLOCK
        return self.qweight.shape[1] * 2 // self.scales.shape[1]

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize().as_subclass(DequantizedWeight)

    def quantized_tensors(self) -> dict[str, torch.Tensor]:
        return {name: buffer for name, buffer in self.named_buffers(recurse=False)}

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full ``[out, in]`` weight in `dtype` (default: the dtype it was quantized from)."""
        return dequantize_weight(self.quantized_tensors(), self.quant_backend, self.in_features,
                                 dtype or self.weight_dtype)

    def quantized_bytes(self) -> int:
        """Bytes of the 4-bit codes and their scales (the bias not included)."""
        return sum(t.numel() * t.element_size() for t in self.quantized_tensors().values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = choose_compute_dtype(x)
        bias = None if self.bias is None else self.bias.to(dtype)
        return DequantizeLinear.apply(x.to(dtype), self, bias)

    def reset_parameters(self) -> None:
        raise MudpuppyError("Linear4bit holds quantized pretrained weights; they cannot be re-initialized")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, quant_backend={self.quant_backend}, group_size={self.group_size}")


# --------------------------------------------------------------------------- whole models


@dataclass(frozen=True)
class QuantReport:
    """What `quantize_model` did. Bytes cover the replaced layers' weights and biases."""

    quant_backend: str
    group_size: int | None  # int4: as requested (None = per row); mxfp4: always 32
    layers: int
    bytes_before: int  # as bf16
    bytes_after: int  # 4-bit codes + scales, biases still counted as bf16

    @property
    def compression_ratio(self) -> float:
        return self.bytes_before / self.bytes_after

    def summary(self) -> str:
        group = "per-row" if self.group_size is None else f"group {self.group_size}"
        return (f"quantized {self.layers} linear layers to {self.quant_backend} ({group}): "
                f"{self.bytes_before / 2**20:.1f} MiB as bf16 -> {self.bytes_after / 2**20:.1f} MiB "
                f"({self.compression_ratio:.2f}x smaller)")


def model_memory_bytes(model: nn.Module) -> int:
    """Bytes held by a model's parameters and buffers, each shared tensor counted once."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def is_skipped(name: str, skip_modules: tuple[str, ...] | list[str]) -> bool:
    """A module is skipped when its qualified name is, or ends with, an entry (``lm_head``, ``mlp.down_proj``)."""
    return any(name == entry or name.endswith("." + entry) for entry in skip_modules)


def find_quantizable_linears(model: nn.Module, skip_modules) -> list[str]:
    """Qualified names of the plain ``nn.Linear`` layers to quantize, in module order.

    Subclasses are left alone: some (MultiheadAttention's out_proj) are used
    through their weight tensor rather than their forward. The output head is
    always skipped, since it usually shares its weight with the embeddings.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return [name for name, module in model.named_modules()
            if type(module) is nn.Linear and module is not head and not is_skipped(name, skip_modules)]


def reject_adapter_layers(model: nn.Module) -> None:
    """Quantizing after PEFT would also quantize the adapters' own nn.Linear layers."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if any(isinstance(module, BaseTunerLayer) for module in model.modules()):
        raise MudpuppyError("quantize the base model before attaching LoRA adapters, not after")


def quantize_model(model: nn.Module, quant_backend: str = "int4", group_size: int | None = 64,
                   skip_modules: tuple[str, ...] | list[str] = ("lm_head",)) -> QuantReport:
    """Replace each ``nn.Linear`` of `model` in place with a frozen `Linear4bit`.

    `group_size` is int4's group length along the input dimension (None: one
    scale per row); MXFP4 always uses the spec's blocks of 32.
    """
    check_quant_backend(quant_backend)
    check_group_size(group_size)
    reject_adapter_layers(model)
    targets = find_quantizable_linears(model, skip_modules)
    if not targets:
        raise MudpuppyError(describe_nothing_to_quantize(model, skip_modules))
    before = after = 0
    # Look each layer up by name so the full-precision original is freed as soon
    # as it is replaced: peak memory grows by one layer, not by the whole model.
    for name in targets:
        linear = model.get_submodule(name)
        quantized = Linear4bit.from_linear(linear, quant_backend, group_size)
        model.set_submodule(name, quantized)
        bias_bytes = 0 if linear.bias is None else linear.bias.numel() * BF16_BYTES
        before += linear.weight.numel() * BF16_BYTES + bias_bytes
        after += quantized.quantized_bytes() + bias_bytes
    reported_group = MX_BLOCK if quant_backend == "mxfp4" else group_size
    return QuantReport(quant_backend, reported_group, len(targets), before, after)


def describe_nothing_to_quantize(model: nn.Module, skip_modules) -> str:
    already = sum(isinstance(module, Linear4bit) for module in model.modules())
    if already:
        return f"{type(model).__name__} is already quantized ({already} Linear4bit layers)"
    return (f"{type(model).__name__} has no nn.Linear layers to quantize (skipped: {', '.join(skip_modules) or 'none'}); "
            "QLoRA needs a model whose projections are linear layers: use adapter.type lora instead")


def dequantize_model(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Replace each `Linear4bit` (PEFT-wrapped or not) with an ``nn.Linear`` of its dequantized weight.

    The weights are exactly those the adapter saw in training, so a merge done
    afterwards reproduces the trained model. Returns the number of layers replaced.
    """
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, Linear4bit)]
    for name, layer in targets:
        model.set_submodule(name, build_dense_linear(layer, dtype or layer.weight_dtype))
    return len(targets)


def build_dense_linear(layer: Linear4bit, dtype: torch.dtype) -> nn.Linear:
    dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                      device=layer.qweight.device, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(layer.dequantize(dtype))
        if layer.bias is not None:
            dense.bias.copy_(layer.bias)
    dense.requires_grad_(False)
    return dense


__all__ = [
    "DequantizedWeight",
    "Linear4bit",
    "QuantReport",
    "dequantize_model",
    "model_memory_bytes",
    "quantize_model",
]
