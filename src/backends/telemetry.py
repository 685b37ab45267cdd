"""Hardware readings of the device a backend runs on, for the --tui dashboard (monitor/): the `Reading`
type and the process's own memory.

A leaf: the runtime-specific readings (backends/torch/devices/telemetry.py for CUDA
and ROCm, backends/mlx/telemetry.py for MLX) import `Reading` from here, and
backends/hardware.py's `read_hardware(backend)`, the one entry point, picks
among them. The process's resident memory (psutil, else the `resource`
module's peak) is read on every backend. A reading that a machine cannot
give (no NVML, no amdsmi, no rocm-smi) is left out: the dashboard shows
what there is and a run never depends on it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Reading:
    """One line of the hardware panel: memory (`used` of `total` bytes) or utilisation (`percent`)."""

    name: str
    used: float | None = None
    total: float | None = None
    percent: float | None = None
    source: str = ""              # where the number comes from: NVML, amdsmi, rocm-smi, torch.cuda, mlx, psutil


def process_readings() -> list[Reading]:
    """Resident memory of this process (and the machine's total), the number that matters on a CPU run."""
    try:
        import psutil
    except ImportError:
        return [peak_rss_from_resource()] if sys.platform != "win32" else []
    rss = psutil.Process(os.getpid()).memory_info().rss
    return [Reading("process RSS", used=rss, total=psutil.virtual_memory().total, source="psutil"),
            Reading("CPU busy", percent=psutil.cpu_percent(interval=None), source="psutil")]


def peak_rss_from_resource() -> Reading:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in kilobytes on Linux and in bytes on macOS.
    return Reading("process peak RSS", used=peak if sys.platform == "darwin" else peak * 1024, source="resource")
