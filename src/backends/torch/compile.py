"""`training.compile: true` on the torch backends: regional compilation of the decoder layers.

Each repeated transformer block's `forward` is compiled in place, not the whole
model: the layers share one code object, so one compiled graph serves all of
them (compile time does not grow with depth), and what runs around them
(embeddings, the chunked loss, PEFT's wrapper) stays eager. It works under
PEFT LoRA (the LoRA modules are inside the layer) and with transformers'
gradient checkpointing, which wraps each layer's `forward` and which dynamo
traces as a checkpoint region.

Why `forward` and not `module.compile()` (which compiles `__call__`): module
hooks stay outside the graph, where transformers keeps them too (its
checkpointing wraps `forward` so FSDP2's hooks are not replayed), and hooks
that move weights (layer streaming) are not traced.

Only training runs compiled (module in train mode, gradients on). Held-out
loss and generation run the same layer eagerly: compiling them would cost a
compile each (no-grad graph, prefill, decode with a KV cache) for code that
runs a few times per run.

Shapes: `dynamic=True`, so sequence length and batch size are symbolic from
the first compile. With torch.compile's default (`dynamic=None`) the first
shape compiles static, the next sequence length recompiles with that
dimension dynamic, and the first short batch recompiles once more, each as
slow as the first compile (benchmarks/compile_cpu.py measures both).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import torch

from ...errors import MudpuppyError
from .handle import unwrap


def compile_layers(model, backend: str | None = None, dynamic: bool | None = True) -> int:
    """Compile each decoder layer of `model` (a transformers model, PEFT-wrapped or not) in place.

    Returns how many layers were compiled. Raises MudpuppyError when the model
    has no recognisable decoder layers, or when torch.compile cannot build
    kernels on this machine (checked here, before training, with a tiny probe).
    `dynamic` is torch.compile's: True (symbolic shapes from the start) or None (its default).
    """
    backend = backend or _backend_name(model)
    layers = find_layers(model)
    if not layers:
        raise MudpuppyError(
            f"training.compile: no transformer decoder layers found in {type(unwrap(model)).__name__} "
            f"on the {backend} backend, so there is nothing to compile regionally; set training.compile: false")
    probe_compiler(_device_of(model), backend)
    for layer in layers:
        layer.forward = TrainingForward(_eager_forward(layer), dynamic)
    return len(layers)


class TrainingForward:
    """A layer's forward: compiled while it trains (train mode, gradients on), eager otherwise."""

    def __init__(self, eager, dynamic: bool | None):
        self.eager = eager                      # the class's forward, bound to the layer
        self.compiled = torch.compile(eager, dynamic=dynamic)

    def __call__(self, *args, **kwargs):
        if self.eager.__self__.training and torch.is_grad_enabled():
            return self.compiled(*args, **kwargs)
        return self.eager(*args, **kwargs)


def _eager_forward(layer):
    """The layer's own forward, also when it was compiled before (compiling twice wraps once)."""
    forward = layer.forward
    return forward.eager if isinstance(forward, TrainingForward) else forward


def find_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks: transformers' GradientCheckpointingLayer instances (every decoder layer
    in transformers 5), else the children of the decoder's `layers` list. Outermost ones only:
    compiling a block compiles what it contains."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    base = unwrap(model)
    found: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in base.modules():              # parents come before their children
        if id(module) in inside:
            continue
        if isinstance(module, GradientCheckpointingLayer):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    if found:
        return found
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    stack = getattr(decoder, "layers", None)
    return list(stack) if isinstance(stack, torch.nn.ModuleList) else []


def cpp_compiler_found() -> bool:
    """Whether inductor has a C++ compiler for CPU kernels: $CXX, else g++ (clang++ on macOS)."""
    default = "clang++" if sys.platform == "darwin" else "g++"
    return sys.platform == "win32" or shutil.which(os.environ.get("CXX", default)) is not None


def kernel_toolchain_missing(device_type: str) -> str | None:
    """What inductor lacks to build kernels for `device_type` ("cpu" or "cuda"), or None."""
    if device_type == "cpu":
        return None if cpp_compiler_found() else "a C++ compiler"
    if device_type == "cuda":
        return None if importlib.util.find_spec("triton") is not None else "triton"
    return f"a kernel backend for {device_type}"


def probe_compiler(device: torch.device, backend: str) -> None:
    """Compile and run a one-line function on `device`: inductor needs a C++ compiler on the
    CPU and Triton (with Python headers and a C compiler) on a GPU, and would otherwise fail
    only at the first training step, deep in a traceback."""
    try:
        probe = torch.compile(lambda x: x * 2 + 1, dynamic=False)
        probe(torch.ones(8, device=device))
    except Exception as exc:    # inductor raises many types; every one here means "cannot build kernels"
        raise MudpuppyError(
            f"training.compile: torch.compile cannot build kernels on the {backend} backend: "
            f"{_first_line(exc)}. {_fix_for(exc, device)} or set training.compile: false") from exc


def _fix_for(exc: Exception, device: torch.device) -> str:
    text = str(exc)
    if "Python.h" in text:
        return "Install the Python development headers (e.g. apt-get install python3-dev)"
    if device.type != "cpu" and ("triton" in text.lower() or "Triton" in type(exc).__name__):
        return "Install Triton for this torch build (pytorch-triton / pytorch-triton-rocm)"
    if device.type == "cpu":
        return "Install a C++ compiler (e.g. apt-get install g++) or point the CXX variable at one"
    return "Check that a C compiler and Triton work for this torch build"


def _first_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _device_of(model) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _backend_name(model) -> str:
    device = _device_of(model)
    if device.type == "cuda" and getattr(torch.version, "hip", None):
        return "rocm"
    return device.type
