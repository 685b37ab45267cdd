"""Apple's MLX runtime (Metal GPU on Apple Silicon; CPU build on Linux)."""

from __future__ import annotations

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


def create(availability: Availability, **_options):
    from .backend import MlxBackend

    return MlxBackend(availability.device, bool(availability.details.get("gpu")))
