"""Apple's MLX runtime (Metal GPU on Apple Silicon; CPU build on Linux)."""

from __future__ import annotations

from ...errors import BackendUnavailable
from ..protocol import Availability

INSTALL = "pip install 'mudpuppy[mlx]'  (or: pip install mlx mlx-lm; on Linux: pip install 'mlx[cpu]' mlx-lm)"


def probe() -> Availability:
    try:
        import mlx.core as mx
    except ImportError:
        return Availability("mlx", False, f"mlx is not installed; install it with: {INSTALL}")
    x = mx.ones((16, 16))
    y = mx.matmul(x, x)
    mx.eval(y)  # a real allocation and computation on MLX's default device
    if float(y[0, 0].item()) != 16.0:
        return Availability("mlx", False, "a 16x16 matmul on MLX gave a wrong result")
    device = mx.default_device()
    gpu = "gpu" in str(device).lower()
    return Availability("mlx", True, device=f"{device} ({'Metal GPU' if gpu else 'CPU only: MLX speed needs Apple Silicon'})",
                        details={"gpu": gpu})


def create(availability: Availability, **_options):
    raise BackendUnavailable(
        "mlx: the MLX runtime is present, but mudpuppy's MLX training path is not part of this release yet; "
        "use --backend cpu (or cuda/rocm) for now"
    )
