"""QLoRA base layers without bitsandbytes: `Linear4bit` and whole-model quantization.

A `Linear4bit` keeps only packed 4-bit codes and their scales (formats in
`quant_formats`); the full-precision weight is rebuilt on the fly, in the
input's dtype (or the autocast dtype), by the frozen-layer mechanism of
model/frozen.py, which also says when it is rebuilt and how merging works.
Runs create them while loading (model/loading.py: each layer quantized as its
weights are read); `quantize_model` swaps the plain ``nn.Linear`` layers of a
model already in memory (except the output head and anything named in
`skip_modules`), one at a time.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass

import torch
from torch import nn

from ....errors import MudpuppyError
from ..model.frozen import FrozenLinear, densify_frozen_linears
from .formats import (
    E8M0_BIAS,
    MX_BLOCK,
    build_e2m1_table,
    check_group_size,
    check_quant_backend,
    dequantize_weight,
    quantize_weight,
)

BF16_BYTES = 2


class Linear4bit(FrozenLinear):
    """A frozen linear layer stored as 4-bit codes (int4 or MXFP4), dequantized on the fly.

    Buffers: ``qweight`` (uint8, two codes a byte) and ``scales`` + ``mins``
    (int4) or ``exponents`` (MXFP4). No full-size weight exists between calls.
    With `stream_to` set, the codes stay in host memory (plain attributes,
    which ``model.to`` leaves alone) and are copied to that device per use.
    """

    def __init__(self, in_features: int, out_features: int, quant_backend: str,
                 tensors: dict[str, torch.Tensor], bias: torch.Tensor | None = None,
                 weight_dtype: torch.dtype = torch.float32, stream_to: torch.device | None = None):
        super().__init__(in_features, out_features, bias, weight_dtype)
        check_quant_backend(quant_backend)
        self.quant_backend = quant_backend
        self.stream_to = stream_to
        self.stored = dict(tensors) if stream_to is not None else None
        if stream_to is None:
            for name, tensor in tensors.items():
                self.register_buffer(name, tensor)

    @classmethod
    def from_linear(cls, linear: nn.Linear, quant_backend: str = "int4", group_size: int | None = 64) -> Linear4bit:
        return cls.from_weight(linear.weight.detach(), linear.bias, quant_backend, group_size)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, quant_backend: str = "int4",
                    group_size: int | None = 64, stream_to: torch.device | None = None) -> Linear4bit:
        """Quantize `weight` where it is (the device, when loading); codes go to host memory when streaming."""
        with torch.no_grad():
            tensors = quantize_weight(weight, quant_backend, group_size)
        if stream_to is not None:
            pin = torch.device(stream_to).type == "cuda"
            tensors = {k: (t.cpu().pin_memory() if pin else t.to("cpu", copy=True)) for k, t in tensors.items()}
        out_features, in_features = weight.shape
        return cls(in_features, out_features, quant_backend, tensors, bias, weight.dtype, stream_to)

    @property
    def group_size(self) -> int:
        """Inputs sharing one scale: the int4 group (the row when per-row) or the MX block."""
        if self.quant_backend == "mxfp4":
            return MX_BLOCK
        tensors = self.quantized_tensors()
        return tensors["qweight"].shape[1] * 2 // tensors["scales"].shape[1]

    def quantized_tensors(self) -> dict[str, torch.Tensor]:
        if self.stored is not None:
            return self.stored
        return {name: buffer for name, buffer in self.named_buffers(recurse=False)}

    def dequantize(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The full ``[out, in]`` weight in `dtype` (default: the dtype it was quantized from),
        written into `out` when given."""
        tensors = self.quantized_tensors()
        if self.stream_to is not None:
            tensors = {k: t.to(self.stream_to, non_blocking=True) for k, t in tensors.items()}
        return fast_dequantize(tensors, self.quant_backend, self.in_features, dtype or self.weight_dtype, out)

    materialize = dequantize
    @property
    def costly_to_rebuild(self) -> bool:
        # Kept from the recompute for the backward only when streamed (a copy over the bus first). On a
        # 1.07B Llama keeping a layer's seven fp32 weights raised the QLoRA peak from 1.59 to 1.71 GB for
        # a step 1.3x faster on this project's CPU (docs/memory.md): QLoRA is chosen for memory.
        return self.stream_to is not None

    @property
    def compute_device(self) -> torch.device:
        return torch.device(self.stream_to) if self.stream_to is not None else self.qweight.device

    def quantized_bytes(self) -> int:
        """Bytes of the 4-bit codes and their scales (the bias not included)."""
        return sum(t.numel() * t.element_size() for t in self.quantized_tensors().values())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, quant_backend={self.quant_backend}, group_size={self.group_size}")


# --------------------------------------------------------------------------- dequantizing fast

EAGER_ENV = "MUDPUPPY_EAGER_DEQUANTIZE"     # set to 1 to skip torch.compile for dequantization
FUSED_MIN_WEIGHTS = 1 << 18                 # smaller CPU layers dequantize eagerly (a compile costs more)
_DEQUANTIZERS: dict[tuple, object] = {}     # GPUs: one shape-generic compiled kernel per device type, format, dtype
_CPU_KERNELS: dict[tuple, object] = {}      # CPU: one compiled kernel per layer shape, format and dtype
FALLBACKS: dict[tuple, str] = {}             # (device type, format, dtype): why the eager code runs there


def fast_dequantize(tensors: dict[str, torch.Tensor], quant_backend: str, in_features: int,
                    dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """`dequantize_weight`, compiled into one fused kernel where inductor can build it, written into
    `out` when given (a reused buffer: see frozen.scratch_weight).

    Eager dequantization makes four passes over the weight (unpack the nibbles,
    convert to float, scale, cast); fused it is one, and dequantization is most
    of what a QLoRA step adds to a LoRA step. The compiled kernel must give the
    eager values bit for bit, since a merge rebuilds the base the adapter
    trained against: each kernel is checked against the eager code on its first
    call, and where it differs, or cannot be built, the eager code runs.
    """
    device = tensors["qweight"].device
    if device.type == "cpu":
        return _dequantize_on_cpu(tensors, quant_backend, in_features, dtype, out)
    key = (device.type, quant_backend, dtype)
    dequantize = _DEQUANTIZERS.get(key)
    if dequantize is None:
        dequantize = _DEQUANTIZERS[key] = _build_dequantizer(device, quant_backend, dtype)
    weight = dequantize(tensors, quant_backend, in_features, dtype)
    return weight if out is None else out.copy_(weight)


def _indexed_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """`unpack_nibbles` written for inductor: code k read through an index (byte k // 2, shifted by 4
    when k is odd) instead of a stack, which inductor leaves as a separate concatenation with two
    intermediate buffers."""
    k = torch.arange(qweight.shape[1] * 2, device=qweight.device)
    return (qweight[:, k // 2] >> (k % 2 * 4).to(torch.uint8)) & 0x0F


def _fused_int4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, in_features: int,
                out: torch.Tensor) -> torch.Tensor:
    """`dequantize_int4` written for inductor (`_indexed_nibbles`): same fp32 arithmetic, one cast."""
    out_features, groups = scales.shape
    codes = _indexed_nibbles(qweight)
    weight = torch.addcmul(mins.float().unsqueeze(-1), codes.float().view(out_features, groups, -1),
                           scales.float().unsqueeze(-1))
    return out.copy_(weight.view(out_features, -1)[:, :in_features])


def _fused_mxfp4(qweight: torch.Tensor, exponents: torch.Tensor, table: torch.Tensor, in_features: int,
                 out: torch.Tensor) -> torch.Tensor:
    """`dequantize_mxfp4` written for inductor: each nibble looks its value up in the 16-entry E2M1
    table (`table`); the power-of-two scale is exact in fp32, then one cast."""
    out_features, blocks = exponents.shape
    codes = _indexed_nibbles(qweight)
    values = table[codes.long()].view(out_features, blocks, MX_BLOCK)
    scales = torch.exp2(exponents.float() - E8M0_BIAS).unsqueeze(-1)
    return out.copy_((values * scales).view(out_features, -1)[:, :in_features])


def _dequantize_on_cpu(tensors, quant_backend, in_features, dtype, out):
    """The CPU path: a kernel compiled for each layer shape (static shapes: inductor's CPU code
    for symbolic ones ran 10-50x slower here), writing straight into `out`.

    Writing into a reused buffer matters as much as fusing: a fresh 23 MB bf16 weight costs a
    page fault per 4 KiB on first touch (memory.return_freed_host_memory hands large buffers
    back to the system), and on this project's CPU the faults took longer than the arithmetic.
    Dequantizing a 5632x2048 int4 layer to bf16 (AMX Xeon, 2 threads): 46 ms eager, 10 ms
    compiled into a fresh tensor, 5 ms compiled into a reused one (benchmarks/dequantize_cpu.py).
    """
    out_features = tensors["qweight"].shape[0]
    kernel = dequantize_weight
    if out_features * in_features >= FUSED_MIN_WEIGHTS and os.environ.get(EAGER_ENV) != "1":
        key = (quant_backend, *(tuple(t.shape) for t in tensors.values()), in_features, dtype)
        kernel = _CPU_KERNELS.get(key)
        if kernel is None:
            out = torch.empty(out_features, in_features, dtype=dtype) if out is None else out
            kernel = _CPU_KERNELS[key] = _build_cpu_kernel(tensors, quant_backend, in_features, out)
    if kernel is dequantize_weight:       # small, asked for, or no fused kernel for this shape
        weight = dequantize_weight(tensors, quant_backend, in_features, dtype)
        return weight if out is None else out.copy_(weight)
    return kernel(tensors, torch.empty(out_features, in_features, dtype=dtype) if out is None else out)


def _build_cpu_kernel(tensors, quant_backend, in_features, out):
    """Compile the fused kernel for one shape and check it on this call's weight (the eager values,
    bit for bit); `dequantize_weight` itself when it differs or cannot be built."""
    from ..compile import kernel_toolchain_missing

    if kernel_toolchain_missing("cpu") is not None:
        return dequantize_weight
    fused = _fused_int4 if quant_backend == "int4" else _fused_mxfp4
    # A fresh code object per shape: dynamo keys its cache by code object, so each shape gets its own
    # entry instead of counting towards one function's recompile limit (8), past which it runs eagerly.
    fused = types.FunctionType(fused.__code__.replace(), fused.__globals__, fused.__name__, fused.__defaults__,
                               fused.__closure__)
    compiled = torch.compile(fused, dynamic=False)
    table = build_e2m1_table() if quant_backend == "mxfp4" else None

    def kernel(tensors, out):
        # One fixed state: dynamo guards on autocast and grad mode, and a layer's backward runs
        # outside the autocast its forward ran in; without this each shape would compile a second,
        # unchecked graph there.
        with torch.autocast("cpu", enabled=False), torch.no_grad():
            if table is None:
                return compiled(tensors["qweight"], tensors["scales"], tensors["mins"], in_features, out)
            return compiled(tensors["qweight"], tensors["exponents"], table, in_features, out)

    try:
        fast = kernel(tensors, out)
    except Exception:   # inductor raises many types; each means "no fused kernel here", not a user error
        return dequantize_weight
    if not same_bits(fast, dequantize_weight(tensors, quant_backend, in_features, out.dtype)):
        return dequantize_weight
    return kernel


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (torch.equal takes -0.0 for 0.0 and never a NaN for itself)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(as_bits(a), as_bits(b))


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its element size (-0.0 and 0.0 differ, a NaN equals itself)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _build_dequantizer(device: torch.device, quant_backend: str, dtype: torch.dtype):
    """A GPU's kernel for one format and output dtype: a shape-generic compiled function (Triton
    handles symbolic shapes well), checked once on a probe layer against the eager code, bit for bit.

    Each (format, dtype) is built and checked on its own, so a format or dtype inductor gets wrong
    (fp16 included) falls back to the eager code alone, and each gets a fresh code object: dynamo counts
    recompiles per code object, and past its limit it would run eagerly without a word, with four
    times the transient memory. Autocast and grad mode are pinned for every call, as on the CPU:
    dynamo guards on both, and backward, merge and DoRA call it under other settings than the
    forward, which would otherwise compile further graphs nobody checked.
    """
    from ..compile import kernel_toolchain_missing

    if os.environ.get(EAGER_ENV) == "1" or kernel_toolchain_missing(device.type) is not None:
        return dequantize_weight
    fresh = types.FunctionType(dequantize_weight.__code__.replace(), dequantize_weight.__globals__,
                               dequantize_weight.__name__, dequantize_weight.__defaults__, dequantize_weight.__closure__)
    compiled = torch.compile(fresh, dynamic=True)

    def kernel(tensors, quant_backend, in_features, dtype):
        with torch.autocast(device.type, enabled=False), torch.no_grad():
            return compiled(tensors, quant_backend, in_features, dtype)

    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(96, 160, generator=generator).to(device)
    key = (device.type, quant_backend, dtype)
    try:
        tensors = quantize_weight(probe, quant_backend, 64 if quant_backend == "int4" else None)
        fast, eager = kernel(tensors, quant_backend, 150, dtype), dequantize_weight(tensors, quant_backend, 150, dtype)
        if not same_bits(fast, eager):
            FALLBACKS[key] = describe_difference(fast, eager)
            return dequantize_weight
    except Exception as exc:   # inductor raises many types; each means "no fused kernel here", not a user error
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        FALLBACKS[key] = f"compiling failed: {type(exc).__name__}: {first}"
        return dequantize_weight
    return kernel


def describe_difference(fast: torch.Tensor, eager: torch.Tensor) -> str:
    """Why a compiled kernel was not used: how far its values are from the eager code's (gpu_check reports it)."""
    if fast.shape != eager.shape or fast.dtype != eager.dtype:
        return f"compiled output {tuple(fast.shape)} {fast.dtype}, eager {tuple(eager.shape)} {eager.dtype}"
    diff = (fast.float() - eager.float()).abs()
    bits = as_bits(fast) != as_bits(eager)      # as same_bits compares them: a zero's sign counts
    return (f"compiled values differ from eager at {int(bits.sum())} of {fast.numel()} elements "
            f"(max abs diff {diff.max().item():.3g}, nan in compiled {bool(fast.isnan().any())})")


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


def summarize_quantized(model: nn.Module) -> QuantReport | None:
    """The report `quantize_model` would have given, read off a model quantized while loading."""
    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    if not layers:
        return None
    before = after = 0
    for layer in layers:
        bias_bytes = 0 if layer.bias is None else layer.bias.numel() * BF16_BYTES
        before += layer.in_features * layer.out_features * BF16_BYTES + bias_bytes
        after += layer.quantized_bytes() + bias_bytes
    return QuantReport(layers[0].quant_backend, layers[0].group_size, len(layers), before, after)


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
    """Replace each `Linear4bit` (and any other frozen layer) with an ``nn.Linear`` of its full weight
    (see `frozen.densify_frozen_linears`), and each 4-bit expert stack with a plain parameter
    (`experts.densify_experts`). Returns the number of layers and stacks replaced."""
    from ..model.experts import densify_experts

    return densify_frozen_linears(model, dtype) + densify_experts(model, dtype)


__all__ = [
    "Linear4bit",
    "QuantReport",
    "dequantize_model",
    "quantize_model",
]
