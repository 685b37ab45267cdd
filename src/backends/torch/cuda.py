"""NVIDIA GPUs through PyTorch's CUDA build."""

from __future__ import annotations

import torch

from ..protocol import Availability
from .backend import DevicePlan, TorchBackend


def probe() -> Availability:
    if getattr(torch.version, "hip", None):
        return Availability("cuda", False, f"this torch build ({torch.__version__}) is for ROCm (HIP {torch.version.hip}); "
                            "AMD GPUs run with --backend rocm")
    if torch.version.cuda is None:
        return Availability("cuda", False, f"this torch build ({torch.__version__}) has no CUDA support; install a CUDA build: "
                            "pip install torch --index-url https://download.pytorch.org/whl/cu128")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return Availability("cuda", False, f"torch {torch.__version__} has CUDA {torch.version.cuda} but sees no NVIDIA GPU "
                            "(check the driver with nvidia-smi and CUDA_VISIBLE_DEVICES)")
    x = torch.ones(64, 64, device="cuda:0")
    ok = bool(torch.isfinite(x @ x).all().item())
    if not ok:
        return Availability("cuda", False, "a matmul on cuda:0 gave non-finite values")
    name = torch.cuda.get_device_name(0)
    return Availability("cuda", True, device=f"cuda:0 ({name})",
                        details={"bf16": torch.cuda.is_bf16_supported(), "devices": torch.cuda.device_count()})


def create(availability: Availability, **_options) -> TorchBackend:
    dtype = torch.bfloat16 if availability.details.get("bf16") else torch.float16
    return TorchBackend(DevicePlan("cuda", torch.device("cuda:0"), dtype))
