"""NVIDIA GPUs through PyTorch's CUDA build.

What is NVIDIA-specific lives here: compute capabilities for bf16 and fp8,
the allocator default and the install command. The mechanics are shared with
ROCm in gpu.py. bitsandbytes and flash-attn are reported when installed
and never required: mudpuppy runs PyTorch SDPA and its own quantizers.
"""

from __future__ import annotations

import os
import sys

import torch

from ...protocol import Availability
from ..backend import TorchBackend
from .gpu import Gpu, GpuKind, plan_gpu_run, probe_kind, reinstall_command, torch_build

CUDA_WHEEL_INDEX = "https://download.pytorch.org/whl/cu128"
BF16_MIN_CAPABILITY = (8, 0)   # Ampere
FP8_MIN_CAPABILITY = (8, 9)    # Ada; Hopper and Blackwell after it
VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES",)


def read_traits(props) -> dict:
    capability = (props.major, props.minor)
    return {
        "arch": f"sm_{props.major}{props.minor}",
        "bf16": capability >= BF16_MIN_CAPABILITY,
        "fp8": capability >= FP8_MIN_CAPABILITY,
    }


def keep_every_gpu(_gpu: Gpu) -> str:
    # No NVIDIA GPU is known to enumerate and then crash; the probe still checks each one.
    return ""


def check_build() -> str:
    build = torch_build()
    if build == "cuda":
        return ""
    install = reinstall_command(CUDA_WHEEL_INDEX)
    if build == "rocm":
        return (f"this torch build ({torch.__version__}) is the ROCm build (HIP {torch.version.hip}). It calls AMD "
                "GPUs 'cuda' devices, but it cannot drive NVIDIA GPUs. On an AMD GPU use --backend rocm; for an "
                f"NVIDIA GPU install the CUDA build, a separate wheel of the same package: {install}")
    return (f"this torch build ({torch.__version__}) has no CUDA support: it is the CPU-only build. "
            f"Install a CUDA build: {install}")


def no_gpu_reason() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES not set"
    return (f"torch {torch.__version__} has CUDA {torch.version.cuda} but sees no NVIDIA GPU: check the driver "
            f"with nvidia-smi, and {shown}")


def allocator_default() -> str:
    # Expandable segments stop fragmentation from varying sequence lengths; the
    # CUDA driver API they rely on exists on Linux only.
    return "expandable_segments:True" if sys.platform.startswith("linux") else "max_split_size_mb:128"


def allocator_notes(value: str) -> list[str]:
    if "expandable_segments:true" in value.replace(" ", "").lower() and not sys.platform.startswith("linux"):
        return [f"expandable_segments is not supported on {sys.platform}; torch ignores it"]
    return []


KIND = GpuKind(
    name="cuda",
    runtime=lambda: f"CUDA {torch.version.cuda}",
    check_build=check_build,
    no_gpu_reason=no_gpu_reason,
    read_traits=read_traits,
    exclude=keep_every_gpu,
    visibility_vars=VISIBILITY_VARS,
    native_allocator_var="PYTORCH_CUDA_ALLOC_CONF",
    allocator_default=allocator_default,
    allocator_notes=allocator_notes,
    fp8_requirement=("fp8 matmuls need compute capability 8.9 or newer "
                     "(Ada: RTX 40xx, L4, L40; Hopper: H100, H200; Blackwell)"),
)


def probe() -> Availability:
    return probe_kind(KIND)


def create(availability: Availability, devices: int | list[int] | None = None,
           precision: str | None = None, memory=None, optimizer: str = "adamw", distributed=None,
           deterministic: bool = False, **_options) -> TorchBackend:
    return TorchBackend(plan_gpu_run(KIND, availability, devices, precision, memory, optimizer, distributed,
                                     deterministic))
