"""Fitting a run in device memory: which options a device can take, activation offload, and
running out of memory well.

Loading at storage precision lives in model/loading.py, host-resident frozen layers
in model/frozen.py, optimizer offload in optimizers.py; this module holds the
activation offload and torch's side of running out (the options check and the
advice are runtime-neutral, in mudpuppy/memory/fit.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import sys

import torch

from ...errors import OutOfDeviceMemory
from ...memory.fit import out_of_memory_message

M_MMAP_THRESHOLD = -3          # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 1 << 20


def release_device_memory(device: torch.device) -> None:
    """Collect what only the garbage collector frees (tensors in reference cycles), then, on a GPU, return
    the caching allocator's unused blocks to the device, for the next phase of the run and for other
    processes (torch keeps freed blocks reserved otherwise)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


@functools.cache
def return_freed_host_memory() -> bool:
    """Have glibc serve allocations of 1 MiB and more with their own mappings, given back on free.

    glibc's default threshold adapts upwards: once a tensor of a few MB has been
    freed, later ones of that size come from the heap, and a heap that has held
    a 1B model's tensors while loading and the activations of a step keeps its
    high-water mark, since it can only shrink from the top. Measured on a 1.07B
    Llama under QLoRA: 2.27 GB peak RSS with the default, 1.46 GB with this
    (benchmarks/memory_scale.py). Tensors this large cost a page fault per 4 KiB
    on first touch either way. Returns whether it applied (glibc only).

    Process-wide and for good: glibc has no call that reads the threshold back or
    returns it to adapting, so it cannot be undone after a scope. It is therefore
    set where its reason is, when a model loads (TorchBackend.load_model), not
    when a backend is made: importing mudpuppy or probing a device leaves the C
    allocator as the process had it.
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):       # musl and other C libraries have no mallopt
        return False


# ---------------------------------------------------------------- activation offload


class ToHost(torch.autograd.Function):
    """A differentiable copy to host memory: the gradient goes back to the tensor's device."""

    @staticmethod
    def forward(ctx, tensor, host, pin):
        ctx.device = tensor.device
        return copy_to(tensor, host, pin)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.device, non_blocking=True), None, None


class ToDevice(torch.autograd.Function):
    """The way back: a copy of a host tensor on the compute device, its gradient copied to the host."""

    @staticmethod
    def forward(ctx, tensor, device):
        ctx.host = tensor.device
        ctx.pin = tensor.is_pinned() if tensor.device.type == "cpu" else False
        return tensor.to(device, non_blocking=True, copy=True)

    @staticmethod
    def backward(ctx, grad):
        return copy_to(grad, ctx.host, ctx.pin), None


def copy_to(tensor: torch.Tensor, host: torch.device, pin: bool) -> torch.Tensor:
    """A real copy of `tensor` in host memory (also when host and device are the same: the tests)."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=host, pin_memory=pin)
    return out.copy_(tensor, non_blocking=pin)


class ActivationOffload:
    """memory.activation_offload: what backward needs is kept in host memory between forward and backward.

    Two parts, because gradient checkpointing already keeps almost nothing:
    - tensors autograd saves outside checkpointed layers (embeddings, final
      norm, the loss head; everything when checkpointing is off) go to the
      host through saved-tensor hooks, as ``torch.autograd.graph.save_on_cpu``
      does, except that parameters stay where they are (they are alive anyway)
      and the copy is always real;
    - with checkpointing, what each layer keeps is its input hidden states: the
      layer's checkpoint function (transformers' `_gradient_checkpointing_func`)
      is replaced by one that moves that input to the host and back for the
      recompute, so the device holds one layer's activations at a time instead
      of one hidden-state tensor per layer.
    Copies from and to pinned host memory run asynchronously on a GPU.
    """

    def __init__(self, device: torch.device, host: torch.device):
        self.device, self.host = torch.device(device), torch.device(host)
        self.pin = self.device.type == "cuda" and self.host.type == "cpu"

    def saving(self):
        """The context the forward runs in."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        if isinstance(tensor, torch.nn.Parameter) or tensor.device != self.device:
            return (None, tensor)
        return (tensor.device, copy_to(tensor, self.host, self.pin))

    @staticmethod
    def _unpack(packed):
        device, tensor = packed
        return tensor if device is None else tensor.to(device, non_blocking=True)

    def install(self, model) -> int:
        """Route every checkpointed layer's input through host memory; returns how many layers."""
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = [m for m in model.modules()
                  if isinstance(m, GradientCheckpointingLayer) and getattr(m, "gradient_checkpointing", False)]
        for layer in layers:
            layer._gradient_checkpointing_func = functools.partial(self.checkpoint, layer._gradient_checkpointing_func)
        return len(layers)

    def checkpoint(self, checkpoint_fn, function, *args, **kwargs):
        """`checkpoint_fn(function, *args)` with the floating tensor arguments held in host memory.

        torch.utils.checkpoint saves (and restores for the recompute) the RNG state and the autocast
        settings of the devices its tensor arguments are on. With every argument on the host it would
        save the CPU's alone: on a GPU the recompute would draw other dropout masks (wrong gradients)
        and run outside the forward's autocast. An empty tensor on the compute device, passed along and
        ignored, keeps that device's state in the checkpoint.
        """
        moved = [ToHost.apply(a, self.host, self.pin) if _offloadable(a, self.device) else a for a in args]
        on_host = [m is not a for m, a in zip(moved, args)]
        anchor = torch.empty(0, device=self.device)

        def run(_anchor, *held):
            back = [ToDevice.apply(h, self.device) if host else h for h, host in zip(held, on_host)]
            return function(*back)

        return checkpoint_fn(run, anchor, *moved, **kwargs)


def _offloadable(value, device: torch.device) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.device == device


# ---------------------------------------------------------------- running out


@contextlib.contextmanager
def explain_out_of_memory(backend: str, training_cfg, adapter_type: str | None, memory, gpu: bool):
    """Turn torch's OutOfMemoryError into one OutOfDeviceMemory error that says what to change."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        message = out_of_memory_message(backend, training_cfg, adapter_type, memory, gpu)
        raise OutOfDeviceMemory(message) from exc
