"""The CPU: always last in auto-detection, and the reference every other backend matches."""

from __future__ import annotations

import torch

from ....errors import MudpuppyError
from ...protocol import Availability
from ..backend import DevicePlan, TorchBackend
from .gpu import make_deterministic
from ....memory.fit import check_memory_options
from ..optimizers import check_optimizer


def cpu_has_fast_bf16() -> bool:
    """True where oneDNN runs bf16 matmuls natively (AVX512-BF16 / AMX); there bf16 autocast is ~4x fp32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def probe() -> Availability:
    a = torch.randn(16, 16)
    b = a @ a.T  # a real allocation and computation, not a flag
    if not torch.isfinite(b).all():
        return Availability("cpu", False, "a 16x16 matmul on the CPU gave non-finite values")
    bf16 = cpu_has_fast_bf16()
    return Availability(
        "cpu", True, device=f"cpu ({torch.get_num_threads()} threads)",
        details={"torch": torch.__version__, "bf16": bf16},
    )


def create(availability: Availability, precision: str | None = None, devices=None, memory=None,
           optimizer: str = "adamw", distributed=None, deterministic: bool = False, **_options) -> TorchBackend:
    if precision in ("fp16", "fp8"):
        # fp16 on a CPU trains without loss scaling and is slower than bf16; fp8 needs GPU kernels.
        raise MudpuppyError(f"training.precision: {precision} needs a GPU; on the cpu backend use bf16 or fp32 "
                            "(auto picks bf16 where the CPU runs it natively)")
    if devices:
        raise MudpuppyError("devices: picks GPUs; the cpu backend has none to pick (remove it or choose rocm/cuda)")
    check_memory_options("cpu", memory, separate=False)
    check_optimizer("cpu", optimizer, memory)
    fast_bf16 = bool(availability.details.get("bf16"))
    autocast = torch.bfloat16 if fast_bf16 else None
    note = "precision: bf16 autocast (native bf16 matmuls)" if fast_bf16 else "precision: fp32 (no native bf16 on this CPU)"
    plan = DevicePlan("cpu", torch.device("cpu"), autocast, notes=[note], memory=memory, optimizer=optimizer,
                      precision="bf16" if fast_bf16 else "fp32", distributed=distributed)
    if deterministic:
        make_deterministic(plan)
    return TorchBackend(plan)
