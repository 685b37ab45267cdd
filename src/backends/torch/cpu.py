"""The CPU: always last in auto-detection, and the reference every other backend matches."""

from __future__ import annotations

import torch

from ..protocol import Availability
from .backend import DevicePlan, TorchBackend


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


def create(availability: Availability, **_options) -> TorchBackend:
    autocast = torch.bfloat16 if availability.details.get("bf16") else None
    return TorchBackend(DevicePlan("cpu", torch.device("cpu"), autocast))
