"""GPU readings for the --tui dashboard on CUDA and ROCm (see backends/telemetry.py).

Memory comes from torch itself: the device's used and total memory
(`torch.cuda.mem_get_info`, every process on the GPU) and what this process's
tensors hold (`memory_allocated`, and its peak). Utilisation comes from the
vendor's management library through `torch.cuda.utilization`, which maps
torch's device index to the right GPU: NVML (pynvml, the nvidia-ml-py
package) on CUDA, amdsmi on ROCm; on ROCm without amdsmi, `rocm-smi --json`,
matched to the device by its PCI bus. A source that fails once is not asked
again: a missing library or tool does not become missing all run long.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import torch

from ...telemetry import Reading

_UNAVAILABLE: set[str] = set()        # utilisation sources that failed in this process


def gpu_readings(device: str, kind: str) -> list[Reading]:
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return []
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    out = [Reading(f"GPU {index} memory", used=total - free, total=total, source="device"),
           Reading(f"GPU {index} tensors", used=torch.cuda.memory_allocated(index), total=total, source="torch"),
           Reading(f"GPU {index} tensors peak", used=torch.cuda.max_memory_allocated(index), total=total,
                   source="torch")]
    busy = utilisation(index, kind)
    if busy is not None:
        out.append(Reading(f"GPU {index} busy", percent=busy[0], source=busy[1]))
    return out


def utilisation(index: int, kind: str) -> tuple[float, str] | None:
    """Percent of the last sample period a kernel ran, and where that figure came from."""
    library = "NVML" if kind == "cuda" else "amdsmi"
    if library not in _UNAVAILABLE:
        try:
            return float(torch.cuda.utilization(index)), library
        except Exception:        # noqa: BLE001 - ImportError, NVMLError, AmdSmiException...: the library is not usable
            _UNAVAILABLE.add(library)
    if kind == "rocm" and "rocm-smi" not in _UNAVAILABLE:
        busy = rocm_smi_busy(index)
        if busy is not None:
            return busy, "rocm-smi"
        _UNAVAILABLE.add("rocm-smi")
    return None


def rocm_smi_busy(index: int) -> float | None:
    tool = shutil.which("rocm-smi")
    if tool is None:
        return None
    try:
        done = subprocess.run([tool, "--showuse", "--showbus", "--json"], capture_output=True, text=True, timeout=5)
        cards = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return pick_card_busy(cards, pci_bus(index))


def pci_bus(index: int) -> str | None:
    """This device's PCI address as rocm-smi prints it (domain:bus:device), when torch knows it."""
    props = torch.cuda.get_device_properties(index)
    parts = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(p is None for p in parts):
        return None
    return f"{parts[0]:04x}:{parts[1]:02x}:{parts[2]:02x}"


def pick_card_busy(cards: dict, bus: str | None) -> float | None:
    """`GPU use (%)` of the card at `bus` in rocm-smi's JSON (of the only card, when the bus is unknown)."""
    gpus = {name: fields for name, fields in cards.items() if isinstance(fields, dict) and "GPU use (%)" in fields}
    if bus is not None:
        gpus = {n: f for n, f in gpus.items() if str(f.get("PCI Bus", "")).lower().startswith(bus)}
    if len(gpus) != 1:
        return None
    try:
        return float(next(iter(gpus.values()))["GPU use (%)"])
    except ValueError:
        return None
