"""AMD GPUs through PyTorch's ROCm (HIP) build; torch exposes them as 'cuda' devices."""

from __future__ import annotations

import torch

from ..protocol import Availability
from .backend import DevicePlan, TorchBackend

ROCM_INSTALL = "pip install torch --index-url https://download.pytorch.org/whl/rocm6.4"


def probe() -> Availability:
    hip = getattr(torch.version, "hip", None)
    if not hip:
        return Availability("rocm", False, f"this torch build ({torch.__version__}) has no HIP support; "
                            f"install the ROCm build: {ROCM_INSTALL}")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return Availability("rocm", False, f"torch {torch.__version__} has HIP {hip} but sees no AMD GPU "
                            "(check rocm-smi, the render group, and HIP_VISIBLE_DEVICES)")
    x = torch.ones(64, 64, device="cuda:0")
    if not bool(torch.isfinite(x @ x).all().item()):
        return Availability("rocm", False, "a matmul on the first GPU gave non-finite values")
    name = torch.cuda.get_device_name(0)
    return Availability("rocm", True, device=f"cuda:0 ({name}, HIP {hip})",
                        details={"bf16": torch.cuda.is_bf16_supported(), "devices": torch.cuda.device_count()})


def create(availability: Availability, **_options) -> TorchBackend:
    dtype = torch.bfloat16 if availability.details.get("bf16") else torch.float16
    return TorchBackend(DevicePlan("rocm", torch.device("cuda:0"), dtype))
