"""Frozen linear layers whose full weight exists only while it is used.

Two kinds share one mechanism: `Linear4bit` (quantization/linear4bit.py) keeps 4-bit codes
and rebuilds the weight from them; `StoredLinear` keeps the weight as stored
(in host memory when streaming, or in bf16 where the device computes in fp32)
and copies or upcasts it. Either way the weight is *materialized*
for the matmul and dropped afterwards, so the device holds at most a layer's
worth of full weights at a time, never the model's.

When a weight is materialized matters for speed. A plain forward and backward
need it twice (``y = x W^T`` forward, ``dx = dy W`` backward). With gradient
checkpointing a layer runs forward, then again (the recompute) right before
its backward: there the trainer sets `keep_for_backward` on layers whose
rebuild is costly (streamed: a copy over the bus), and the recomputed weight
is saved for the backward that follows at once, so each use costs two
materializations per micro-batch, not three, and only one layer's weights are
alive at a time (the first, non-recomputed forward's copy is dropped by the
checkpoint as usual).

Both subclass ``nn.Linear`` because PEFT only wraps layers that pass
``isinstance(layer, nn.Linear)``. ``weight`` is a read-only property:
readers such as DoRA's weight norm get the full values, while an in-place
write (PEFT's merge: ``base_layer.weight.data += delta``) raises instead of
silently editing a temporary copy. To merge, `densify_frozen_linears` first
turns each layer back into an ``nn.Linear`` holding exactly the weight the
adapter was trained against.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import nn

from ....errors import MudpuppyError

MERGE_HINT = (
    "this frozen layer keeps its weight outside the module (4-bit codes, or host memory); `.weight` is a "
    "read-only copy rebuilt on each read, so writing to it (as PEFT's merge does) would change nothing. Call "
    "mudpuppy.backends.torch.model.frozen.densify_frozen_linears(model) (dequantize_model for QLoRA) first: it swaps "
    "each such layer for an nn.Linear holding the full weight, and the adapter then merges normally."
)


class ReadOnlyWeight(torch.Tensor):
    """A temporary full-precision copy of a frozen layer's weight.

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


def choose_compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for x's device, else x's own dtype."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class FrozenLinearFunction(torch.autograd.Function):
    """``x @ W.T + b`` with W materialized in forward, and in backward unless the layer keeps it.

    Saving W for backward, as ``F.linear`` would, keeps every layer's full
    weight alive from forward to backward: the very memory these layers exist
    to save. Only under checkpointing's recompute (`keep_for_backward`) is it
    kept, for the backward that runs right after.
    """

    @staticmethod
    def forward(ctx, x, layer, bias):
        ctx.layer, ctx.dtype = layer, x.dtype
        if layer.row_chunk:
            ctx.kept = False
            out = torch.cat([F.linear(x, layer.materialize_rows(a, b, x.dtype)) for a, b in row_spans(layer)], -1)
            return out if bias is None else out + bias
        ctx.kept = layer.keep_for_backward
        if ctx.kept:
            weight = layer.materialize(x.dtype)
            ctx.save_for_backward(weight)
        else:
            weight = layer.materialize(x.dtype, out=scratch_weight(layer, x.dtype))
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        grad_x = grad_bias = None
        layer = ctx.layer
        if ctx.needs_input_grad[0] and layer.row_chunk:
            grad_x = sum(grad_output[..., a:b] @ layer.materialize_rows(a, b, grad_output.dtype)
                         for a, b in row_spans(layer))
        elif ctx.needs_input_grad[0]:
            if ctx.kept:
                weight = ctx.saved_tensors[0]
            else:
                weight = layer.materialize(ctx.dtype, out=scratch_weight(layer, ctx.dtype))
            grad_x = grad_output @ weight.to(grad_output.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
        return grad_x, None, grad_bias


def row_spans(layer) -> list[tuple[int, int]]:
    step = layer.row_chunk
    return [(start, min(start + step, layer.out_features)) for start in range(0, layer.out_features, step)]


_SCRATCH = threading.local()


def scratch_weight(layer: FrozenLinear, dtype: torch.dtype) -> torch.Tensor | None:
    """A reused ``[out, in]`` buffer for a weight materialized for one matmul and dropped after it,
    or None where a fresh tensor is as good.

    On a CPU a fresh weight-sized tensor costs a page fault per 4 KiB on first touch, since
    memory.return_freed_host_memory has large buffers handed back to the system when freed
    (what keeps a run's peak RSS down). A QLoRA step materializes each frozen weight three
    times (forward, recompute, backward); into fresh tensors the faults took longer than the
    dequantization itself on this project's CPU. One buffer per thread and dtype, sized for
    the largest layer (23 MB in bf16 on a 1.07B Llama), serves them all, one at a time. GPUs
    have a caching allocator, and a compiled region plans its own memory: neither gets one.
    A layer may ignore the buffer and return a fresh weight (GPTQ's unpacking builds one anyway).
    """
    device = layer.compute_device
    if device.type != "cpu" or torch.compiler.is_compiling():
        return None
    numel = layer.out_features * layer.in_features
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    flat = buffers.get(dtype)
    if flat is None or flat.numel() < numel:
        buffers[dtype] = flat = None        # free the smaller one before allocating
        # A normal tensor even when first asked for under inference_mode: an inference tensor
        # could not be written outside it, by every later training step.
        with torch.inference_mode(False):
            flat = buffers[dtype] = torch.empty(numel, dtype=dtype, device=device)
    return flat[:numel].view(layer.out_features, layer.in_features)


class FrozenLinear(nn.Linear):
    """Base of the layers above: subclasses store the weight their way and implement `materialize`."""

    keep_for_backward = False     # set per layer by `keep_weights_for_backward` when checkpointing
    row_chunk: int | None = None  # materialize this many output rows at a time (a vocabulary-sized head)
    tied = False                  # the weight is another module's parameter (a tied output head)
    costly_to_rebuild = True      # whether keeping the rebuilt weight for backward is worth its memory

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, weight_dtype: torch.dtype):
        # Skip nn.Linear.__init__: it would allocate the full-precision weight we are avoiding.
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.weight_dtype = weight_dtype
        bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.register_parameter("bias", bias)

    def materialize(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The full ``[out, in]`` weight on the compute device, in `dtype` (default: `weight_dtype`).

        `out` (a `scratch_weight` buffer) is where to write it when given; callers use the
        returned tensor, which a layer may build fresh instead."""
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        if getattr(_READS, "without_values", False):
            # Shape, dtype and device only: a zero-stride view that costs no memory and no rebuild.
            empty = torch.zeros((), dtype=self.weight_dtype, device=self.compute_device)
            return empty.expand(self.out_features, self.in_features).as_subclass(ReadOnlyWeight)
        return self.materialize().as_subclass(ReadOnlyWeight)

    @property
    def compute_device(self) -> torch.device:
        """Where the full weight is materialized."""
        raise NotImplementedError

    def materialize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Output rows ``start:stop`` of the full weight (for layers with a `row_chunk`)."""
        return self.materialize(dtype)[start:stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = choose_compute_dtype(x)
        bias = None if self.bias is None else self.bias.to(dtype)
        return FrozenLinearFunction.apply(x.to(dtype), self, bias)

    def reset_parameters(self) -> None:
        raise MudpuppyError(f"{type(self).__name__} holds frozen pretrained weights; they cannot be re-initialized")


class StoredLinear(FrozenLinear):
    """A frozen linear whose weight is kept as stored and brought to the compute dtype and device per use.

    Two uses. Streaming: the weight lives in host memory (pinned on a GPU, so
    the copy runs asynchronously) and visits the device for each use; it is a
    plain attribute, not a parameter or buffer, so ``model.to(device)`` leaves
    it where it is. Compact storage: on a device that computes in fp32 but
    holds bf16 checkpoints (a CPU without native bf16), the weight stays in
    bf16 on the device, half the memory, and is upcast per use; the values the
    matmul sees are the checkpoint's exactly. With host and device both the
    CPU (the tests) a streamed copy is still a real copy, so the mechanism
    tested is the one a GPU run uses.
    """

    def __init__(self, stored: torch.Tensor, bias: torch.Tensor | None, device: torch.device, streamed: bool):
        super().__init__(stored.shape[1], stored.shape[0], bias, stored.dtype)
        self.stored = stored
        self.device = torch.device(device)
        self.streamed = streamed

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device,
                    host: torch.device | None = None) -> StoredLinear:
        """Keep `weight` (already in its storage dtype) in `host` memory when given, else on `device`."""
        device = torch.device(device)
        if host is None:
            stored = weight.detach().to(device)
        else:
            stored = weight.detach().to(host, copy=True)
            if device.type == "cuda":
                stored = stored.pin_memory()
        bias = None if bias is None else bias.detach().to(device)
        return cls(stored, bias, device, streamed=host is not None)

    @property
    def compute_device(self) -> torch.device:
        return self.device

    @property
    def costly_to_rebuild(self) -> bool:
        return self.streamed       # a copy over the bus; a compact layer's upcast is cheap

    def materialize(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        dtype = dtype or self.weight_dtype
        if out is not None:
            return out.copy_(self.stored, non_blocking=self.streamed)
        if not self.streamed:
            return self.stored.to(dtype)
        # Copy as stored (half the bytes of fp32 over the bus), then convert on the device.
        return self.stored.to(self.device, non_blocking=True, copy=True).to(dtype)

    def materialize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        rows = self.stored[start:stop]
        return rows.to(self.device, non_blocking=True, copy=True).to(dtype) if self.streamed else rows.to(dtype)

    @classmethod
    def tied_to(cls, embedding: nn.Embedding, row_chunk: int, weight_dtype: torch.dtype) -> StoredLinear:
        """An output head reading the (compact) input embedding's weight, `row_chunk` vocabulary rows at a
        time: upcasting a 49k x 2048 head whole would hold 400 MB for every loss chunk."""
        weight = embedding.weight
        layer = cls(weight.detach(), None, weight.device, streamed=False)
        layer.weight_dtype, layer.row_chunk, layer.tied = weight_dtype, row_chunk, True
        return layer

    def extra_repr(self) -> str:
        where = f"in {self.stored.device} memory, computed on {self.device}" if self.streamed else "on the device"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight stored in {str(self.stored.dtype).removeprefix('torch.')} {where}")


@contextlib.contextmanager
def weight_reads_without_values():
    """Within: a frozen layer's ``.weight`` has the right shape, dtype and device but no values.

    Wrapping layers, PEFT reads ``.weight`` some twenty times per layer only for
    its device, dtype and shape; rebuilding the full weight each time (a 4-bit
    dequantization, or a host-to-device copy) made attaching LoRA to a 1B model
    take minutes. Not for DoRA, whose magnitude starts from the weight's norms.

    Per thread: the server decodes on threads while another may attach an adapter,
    and a decode must read real values.
    """
    before = getattr(_READS, "without_values", False)
    _READS.without_values = True
    try:
        yield
    finally:
        _READS.without_values = before


# Whether this thread is inside `weight_reads_without_values` (False where never set).
_READS = threading.local()


HEAD_ROW_CHUNK = 8192     # vocabulary rows of a tied output head upcast at a time: 64 MB in fp32 at hidden 2048


class UpcastOutput:
    """A forward hook: the module's output in `dtype` (a compact embedding's rows, upcast exactly)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, module, args, output):
        return output.to(self.dtype)


def compute_compact_embeddings(model: nn.Module, compute: torch.dtype) -> bool:
    """Let a model whose input embedding is stored in a 16-bit dtype compute in `compute`.

    The embedding's output is upcast (exact); a tied output head becomes a
    `StoredLinear` over the same 16-bit tensor, upcast a chunk of rows at a
    time. Returns whether the embedding is compact. On a 1.07B Llama with a
    49k vocabulary this keeps 200 MB of a QLoRA run's 1.6 GB.
    """
    embedding = model.get_input_embeddings()
    if embedding is None or embedding.weight.dtype == compute:
        return False
    embedding.register_forward_hook(UpcastOutput(compute))
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is embedding.weight:
        model.set_output_embeddings(StoredLinear.tied_to(embedding, HEAD_ROW_CHUNK, compute))
    return True


def keep_weights_for_backward(model: nn.Module, keep: bool) -> int:
    """Turn `keep_for_backward` on (where rebuilding is costly) or off for every frozen layer;
    returns how many layers keep their weight.

    A compact layer's upcast costs little next to its matmul (23 ms for a
    5632x2048 weight on this project's CPU), so it is rebuilt for the backward
    instead: with the seven weights of a 1B model's layer kept, the peak of a
    LoRA step grew by 130 MB. 4-bit layers rebuild too (QLoRA is for memory;
    see quantization/linear4bit.py). Host-to-device copies cost more, and streamed layers
    keep theirs.
    """
    kept = 0
    for layer in model.modules():
        if isinstance(layer, FrozenLinear):
            layer.keep_for_backward = keep and layer.costly_to_rebuild
            kept += layer.keep_for_backward
    return kept


def densify_frozen_linears(model: nn.Module, dtype: torch.dtype | None = None,
                           device: torch.device | None = None) -> int:
    """Replace each frozen layer (PEFT-wrapped or not) with an ``nn.Linear`` of its full weight.

    The weights are exactly those an adapter saw in training, so a merge done
    afterwards reproduces the trained model. Returns the number of layers replaced.
    """
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, FrozenLinear)]
    for name, layer in targets:
        model.set_submodule(name, build_dense_linear(layer, dtype or layer.weight_dtype, device))
    return len(targets)


def build_dense_linear(layer: FrozenLinear, dtype: torch.dtype, device: torch.device | None = None) -> nn.Linear:
    weight = layer.materialize(dtype)
    dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                      device=device or weight.device, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(weight)
        if layer.bias is not None:
            dense.bias.copy_(layer.bias)
    dense.requires_grad_(False)
    return dense
