"""AMD GPUs through PyTorch's ROCm (HIP) build; torch exposes them as 'cuda' devices.

What is AMD-specific lives here: which architectures are integrated GPUs to
skip (and to hide from HIP before it starts: visibility.py, from the KFD
topology kfd.py reads), which have native bf16 and fp8, the allocator default,
and the install command. The mechanics (probe, selection, precision,
environment) are shared with CUDA in gpu.py.
"""

from __future__ import annotations

import os
import re

import torch

from ...protocol import Availability
from . import kfd, visibility
from ..backend import TorchBackend
from .gpu import (
    ALLOW_IGPU_VAR,
    Gpu,
    GpuKind,
    igpu_allowed,
    plan_gpu_run,
    probe_kind,
    reinstall_command,
    torch_build,
)

ROCM_WHEEL_INDEX = "https://download.pytorch.org/whl/rocm7.2"

# Integrated Radeon GPUs that ROCm enumerates next to a discrete card. They are
# small (2-16 CUs), mostly unsupported by ROCm, and several segfault on the
# first kernel (the gfx1036 of a Ryzen 7000/9000 desktop is the classic case),
# which a probe cannot survive, so they are skipped by name before probing.
SMALL_IGPU_ARCHS = {
    "gfx902": "Raven Ridge / Picasso Vega",
    "gfx909": "Raven 2 Vega",
    "gfx90c": "Renoir / Cezanne / Barcelo Vega",
    "gfx1033": "Van Gogh (Steam Deck)",
    "gfx1035": "Rembrandt (Radeon 660M/680M)",
    "gfx1036": "Raphael / Granite Ridge (Ryzen 7000/9000 desktop iGPU)",
    "gfx1037": "Mendocino (Radeon 610M)",
    "gfx1103": "Phoenix / Hawk Point (Radeon 740M-780M)",
    "gfx1150": "Strix Point (Radeon 880M/890M)",
    "gfx1152": "Krackan Point (Radeon 820M-860M)",
}
# APUs that *are* the machine's accelerator (large unified memory, supported by
# ROCm): never skipped, even though the driver reports them as integrated.
CAPABLE_APU_ARCHS = {
    "gfx1151": "Strix Halo (Radeon 8050S/8060S)",
    "gfx942": "MI300A",
}
# PCI device ids of the small iGPUs above: they name an iGPU where the architecture is not known
# (amd-smi without it). Strix Halo (0x1586) is a capable APU and is not listed.
SMALL_IGPU_DEVICE_IDS = {
    0x15dd: "Raven Ridge", 0x15d8: "Picasso", 0x1636: "Renoir", 0x1638: "Cezanne", 0x164c: "Lucienne",
    0x15e7: "Barcelo", 0x163f: "Van Gogh", 0x1681: "Rembrandt", 0x164e: "Raphael", 0x13c0: "Granite Ridge",
    0x1506: "Mendocino", 0x15bf: "Phoenix", 0x15c8: "Phoenix 2", 0x150e: "Strix Point",
}
# Native bf16 matrix instructions: CDNA (MI100 onward), RDNA3 and RDNA4.
# RDNA2 (gfx103x) and Vega (gfx90x) emulate bf16 slowly, so fp16 is used there.
BF16_ARCH_PREFIXES = ("gfx908", "gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")
# fp8 matmuls: MI300 (fnuz formats), MI350 and RDNA4 (OCP formats).
FP8_ARCHS = ("gfx942", "gfx950")
FP8_ARCH_PREFIXES = ("gfx12",)

# Expandable segments reached ROCm in torch 2.11, gated on ROCm >= 7.0.
EXPANDABLE_MIN_TORCH = (2, 11)
EXPANDABLE_MIN_ROCM = (7, 0)
# Why not expandable segments by default: on ROCm they are recent, with open
# reports of hangs in hsaKmtMemoryVaMap and of zeroed memory when combined with
# max_split_size_mb. Capping the split size is the long-proven remedy for the
# fragmentation that LoRA training's varying sequence lengths cause.
ALLOCATOR_DEFAULT = "max_split_size_mb:128"
VISIBILITY_VARS = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


def read_arch(props) -> str:
    """'gfx90a' from 'gfx90a:sramecc+:xnack-' (the feature flags do not change what runs)."""
    return (getattr(props, "gcnArchName", "") or "unknown").split(":")[0]


def read_traits(props) -> dict:
    arch = read_arch(props)
    return {
        "arch": arch,
        "bf16": arch.startswith(BF16_ARCH_PREFIXES),
        "fp8": arch in FP8_ARCHS or arch.startswith(FP8_ARCH_PREFIXES),
    }


def find_exclusion(gpu: Gpu) -> str:
    if igpu_allowed() or gpu.arch in CAPABLE_APU_ARCHS:
        return ""
    label = SMALL_IGPU_ARCHS.get(gpu.arch)
    if not (label or gpu.integrated):
        return ""
    what = f"integrated GPU, {label}" if label else "integrated GPU"
    return (f"{what}: these often crash on basic operations under ROCm, and while HIP sees one, work on the "
            f"discrete GPU can fail too (hide it with ROCR_VISIBLE_DEVICES); set {ALLOW_IGPU_VAR}=1 to try it")


def igpu_reason(gpu: kfd.KfdGpu) -> str:
    """Why HIP should not see this GPU (KFD's view, the hardware's own architecture), or ''."""
    if gpu.arch in CAPABLE_APU_ARCHS:
        return ""
    label = SMALL_IGPU_ARCHS.get(gpu.arch) or SMALL_IGPU_DEVICE_IDS.get(gpu.device_id)
    if label:
        what = f"integrated GPU, {label}"
    elif gpu.combined_node:
        what = "integrated GPU (its KFD node holds the CPU cores too)"
    else:
        return ""
    override = os.environ.get("HSA_OVERRIDE_GFX_VERSION")
    if override:
        what += (f"; HSA_OVERRIDE_GFX_VERSION={override} makes HIP report another architecture, "
                 f"the kernel reads {gpu.arch}")
    return what


def hip_started() -> bool:
    return torch.cuda.is_initialized() or kfd.kfd_open()


def hide_integrated_gpus() -> tuple[list[str], str]:
    """Hide small iGPUs from HIP before torch starts it: (notes, problem); problem is '' unless HIP had
    already started in a library call (the `mudpuppy` command restarts itself instead)."""
    if igpu_allowed():
        return [], ""
    decision = visibility.decide(kfd.list_gpus(), igpu_reason, os.environ)
    problem = visibility.apply(decision, hip_started(), ALLOW_IGPU_VAR)
    return decision.notes, problem


def check_build() -> str:
    build = torch_build()
    if build == "rocm":
        return ""
    install = reinstall_command(ROCM_WHEEL_INDEX)
    if build == "cuda":
        return (f"this torch build ({torch.__version__}) has no HIP support: it is the CUDA build "
                f"(CUDA {torch.version.cuda}), which drives NVIDIA GPUs only. AMD GPUs need PyTorch's ROCm "
                f"build, a separate wheel of the same package: {install}. "
                "On an NVIDIA GPU use --backend cuda instead")
    return (f"this torch build ({torch.__version__}) has no HIP support: it is the CPU-only build. "
            f"Install the ROCm build: {install}")


def no_gpu_reason() -> str:
    shown = [f"{v}={os.environ[v]!r}" for v in ("ROCR_VISIBLE_DEVICES", *VISIBILITY_VARS) if v in os.environ]
    return (f"torch {torch.__version__} has HIP {torch.version.hip} but sees no AMD GPU: check that `rocminfo` "
            "lists one, that your user is in the render and video groups, and the visibility variables "
            f"({', '.join(shown) if shown else 'none set'})")


def parse_version(text: str | None) -> tuple[int, int]:
    """(major, minor) from '2.13.0+rocm7.2' or '7.2.53211-abc'; (0, 0) when unreadable."""
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def expandable_segments_supported(torch_version: str | None = None, hip_version: str | None = None) -> bool:
    torch_version = torch_version or torch.__version__
    hip_version = hip_version or getattr(torch.version, "hip", None)
    return (parse_version(torch_version) >= EXPANDABLE_MIN_TORCH
            and parse_version(hip_version) >= EXPANDABLE_MIN_ROCM)


def allocator_notes(value: str) -> list[str]:
    """Warnings about an allocator setting the user chose; mudpuppy keeps it either way."""
    options = dict(part.split(":", 1) for part in value.split(",") if ":" in part)
    if options.get("expandable_segments", "").strip().lower() != "true":
        return []
    if not expandable_segments_supported():
        return [(f"expandable_segments is ignored by torch {torch.__version__} with HIP {torch.version.hip}: "
                 "on ROCm it needs torch >= 2.11 built with ROCm >= 7.0")]
    if "max_split_size_mb" in options:
        return [("expandable_segments together with max_split_size_mb has been reported to return zeroed memory "
                 "on some ROCm releases; keep one of the two")]
    return ["expandable_segments on ROCm is recent: if a run hangs while moving tensors to the GPU, unset it"]


KIND = GpuKind(
    name="rocm",
    runtime=lambda: f"HIP {torch.version.hip}",
    check_build=check_build,
    no_gpu_reason=no_gpu_reason,
    read_traits=read_traits,
    exclude=find_exclusion,
    visibility_vars=VISIBILITY_VARS,
    native_allocator_var="PYTORCH_HIP_ALLOC_CONF",
    allocator_default=lambda: ALLOCATOR_DEFAULT,
    allocator_notes=allocator_notes,
    fp8_requirement="fp8 matmuls need an AMD Instinct MI300 (gfx942) or MI350 (gfx950), or a Radeon RX 9000 (gfx12)",
)


def probe() -> Availability:
    """Hide iGPUs first (HIP reads visibility once, at its start), then the shared probe."""
    if check_build():
        return probe_kind(KIND)   # the wrong-build message, before anything reads the GPUs
    notes, problem = hide_integrated_gpus()
    if problem:
        return Availability(KIND.name, False, problem)
    result = probe_kind(KIND)
    if notes:
        result.details["visibility"] = notes
        if result.available:
            result.device = "\n      ".join([result.device, *notes])
    return result


def create(availability: Availability, devices: int | list[int] | None = None,
           precision: str | None = None, memory=None, optimizer: str = "adamw", distributed=None,
           deterministic: bool = False, **_options) -> TorchBackend:
    """One GPU, loaded on the CPU first and moved whole: `device_map="auto"` segfaults with an iGPU present."""
    return TorchBackend(plan_gpu_run(KIND, availability, devices, precision, memory, optimizer, distributed,
                                     deterministic))
