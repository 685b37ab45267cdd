"""Apple's MLX runtime (Metal GPU on Apple Silicon; CPU build on Linux)."""

from __future__ import annotations

from ...errors import MudpuppyError
from ...memory.fit import UNIFIED_MEMORY, check_memory_options
from ..protocol import Availability

INSTALL = "pip install 'mudpuppy[mlx]'  (or: pip install mlx mlx-lm; on Linux: pip install 'mlx[cpu]' mlx-lm)"


def probe() -> Availability:
    try:
        import mlx.core as mx
    except ImportError:
        return Availability("mlx", False, f"mlx is not installed; install it with: {INSTALL}")
    try:
        import mlx_lm  # noqa: F401  (models and KV caches come from mlx-lm)
    except ImportError:
        return Availability("mlx", False, f"mlx-lm is not installed; install it with: {INSTALL}")
    x = mx.ones((16, 16))
    y = mx.matmul(x, x)
    mx.eval(y)  # a real allocation and computation on MLX's default device
    if float(y[0, 0].item()) != 16.0:
        return Availability("mlx", False, "a 16x16 matmul on MLX gave a wrong result")
    device = mx.default_device()
    gpu = "gpu" in str(device).lower()
    where = "Metal GPU" if gpu else "CPU only: MLX speed needs Apple Silicon"
    return Availability("mlx", True, device=f"{device} ({where})", details={"gpu": gpu})


# training.optimizer values that are torchao's low-bit AdamW classes (torch backends only).
TORCHAO_OPTIMIZERS = {"adamw_8bit": "AdamW8bit", "adamw_4bit": "AdamW4bit"}


def create(availability: Availability, memory=None, optimizer: str = "adamw", deterministic: bool = False,
           **_options):
    """The backend, once the options MLX cannot honour are refused: before any model loads."""
    check_memory_options("mlx", memory, separate=False, reason=UNIFIED_MEMORY)
    check_optimizer(optimizer)
    if deterministic:
        raise MudpuppyError("training.deterministic switches torch's deterministic algorithms on; mlx has no such "
                            "switch. Remove the key for this run, or run it with --backend cpu, cuda or rocm")
    from .backend import MlxBackend

    return MlxBackend(availability.device, bool(availability.details.get("gpu")))


def check_optimizer(name: str) -> None:
    """8-bit and 4-bit AdamW are torchao's, which runs on torch tensors only."""
    if name in TORCHAO_OPTIMIZERS:
        raise MudpuppyError(
            f"training.optimizer: {name} on the mlx backend uses torchao's {TORCHAO_OPTIMIZERS[name]}, which runs "
            "on the torch backends only (cpu, cuda, rocm); use adamw, or adafactor for a smaller optimizer state")
