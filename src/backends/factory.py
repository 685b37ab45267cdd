"""Backend registry: names to lazily imported implementations and real probes.

A backend is available only if its probe allocates memory and computes on the
device; an import that succeeds or a flag that says yes is not enough.
"""

from __future__ import annotations

import importlib
import os
from typing import Callable

from ..errors import BackendUnavailable
from .protocol import Availability, BackendProtocol

# name -> (module holding `probe()` and `create()`, one-line description).
# Order matters for "auto": accelerators first, the CPU last. MLX on Linux runs
# on the CPU ~30x slower than torch, so "auto" picks it only on a Metal GPU.
_REGISTRY: dict[str, tuple[str, str]] = {
    "rocm": ("mudpuppy.backends.torch.devices.rocm", "AMD GPUs through PyTorch's ROCm (HIP) build"),
    "cuda": ("mudpuppy.backends.torch.devices.cuda", "NVIDIA GPUs through PyTorch's CUDA build"),
    "mlx": ("mudpuppy.backends.mlx", "Apple's MLX (Metal GPU on Apple Silicon, CPU elsewhere)"),
    "cpu": ("mudpuppy.backends.torch.devices.cpu", "PyTorch on the CPU"),
}


# Packages whose absence means "this backend cannot run here".
_RUNTIMES = {"torch", "mlx", "mlx_lm"}


def backend_names() -> list[str]:
    return list(_REGISTRY)


def describe(name: str) -> str:
    return _REGISTRY[name][1]


def probe(name: str) -> Availability:
    """Probe one backend; never raises for a missing runtime, only reports it."""
    if name not in _REGISTRY:
        return Availability(name, False, f"unknown backend (choose from {', '.join(['auto', *_REGISTRY])})")
    try:
        module = importlib.import_module(_REGISTRY[name][0])
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in _RUNTIMES:
            raise  # a broken mudpuppy install is a bug, not an unavailable backend
        return Availability(name, False, f"its runtime is not installed ({exc.name})")
    try:
        return module.probe()
    except Exception as exc:  # a probe that crashes means "not usable here"
        return Availability(name, False, f"probe failed: {type(exc).__name__}: {exc}")


def probe_all() -> list[Availability]:
    return [probe(name) for name in _REGISTRY]


def resolve_auto(prober: Callable[[str], Availability] = probe) -> Availability:
    for name in _REGISTRY:
        result = prober(name)
        if result.available and (name != "mlx" or result.details.get("gpu")):
            return result
    return prober("cpu")


def create_backend(name: str = "auto", **options) -> BackendProtocol:
    """Return a ready backend, or raise `BackendUnavailable` saying why and what is available."""
    name = (name or "auto").lower()
    set_here = options.get("deterministic") and name in CUBLAS_BACKENDS and CUBLAS_WORKSPACE not in os.environ
    if set_here:
        # cuBLAS reads its workspace setting once, at its first call: the GPU probe's matmul.
        os.environ[CUBLAS_WORKSPACE] = DETERMINISTIC_WORKSPACE
    backend = None
    try:
        backend = _create(name, options)
    finally:
        if set_here and getattr(backend, "name", None) not in CUBLAS_BACKENDS:
            del os.environ[CUBLAS_WORKSPACE]     # no GPU backend came of it: the environment as it was
    return backend


# training.deterministic on an NVIDIA or AMD GPU needs cuBLAS' (hipBLAS') fixed workspace. It stays set
# while the backend lives: torch's deterministic switch is process-wide and checks the variable again at
# every cuBLAS call, so it cannot be scoped narrower than that switch. Nothing else is written.
CUBLAS_WORKSPACE, DETERMINISTIC_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG", ":4096:8"
CUBLAS_BACKENDS = ("auto", "cuda", "rocm")


def _create(name: str, options: dict) -> BackendProtocol:
    if name == "auto":
        result = resolve_auto()
    elif name not in _REGISTRY:
        raise BackendUnavailable(
            f"unknown backend {name!r}; choose one of: auto, {', '.join(_REGISTRY)}"
        )
    else:
        result = probe(name)
    if not result.available:
        usable = [a.name for a in probe_all() if a.available]
        raise BackendUnavailable(
            f"{result.name}: {result.reason}\n"
            f"available here: {', '.join(usable) if usable else 'none'} (see `mudpuppy backends`)"
        )
    module = importlib.import_module(_REGISTRY[result.name][0])
    return module.create(result, **options)
