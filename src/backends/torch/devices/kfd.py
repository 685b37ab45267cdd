"""AMD GPUs as the kernel's KFD driver lists them, read without starting HIP.

HIP reads its visibility variables (ROCR_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES)
once, when it initialises, and `torch.cuda.is_available()` initialises it. To
hide an integrated GPU before that happens, mudpuppy needs the GPU list from
somewhere else: the KFD topology in sysfs, which is what ROCm itself reads
(libhsakmt), or `amd-smi` when sysfs cannot be read. Nothing here imports
torch or opens a device.

How ROCm numbers GPUs: ROCr walks the KFD nodes in order; a node with CPU cores
is a CPU agent, a node with SIMDs is a GPU agent (an old-style APU node has
both), and ROCR_VISIBLE_DEVICES indexes the GPU agents in that order. libhsakmt
skips a GPU node whose DRM render node it cannot open, so such a node takes no
index either. The architecture in sysfs (`gfx_target_version`) is the
hardware's own: HSA_OVERRIDE_GFX_VERSION is applied later, in user space, so a
Radeon 780M run with the override still reads gfx1103 here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")
DRI = Path("/dev/dri")
PROC_FDS = Path("/proc/self/fd")
KFD_DEVICE = "/dev/kfd"
AMD_SMI_TIMEOUT_S = 20


@dataclass(frozen=True)
class KfdGpu:
    """One GPU agent in ROCr's order (the index ROCR_VISIBLE_DEVICES uses)."""

    index: int            # position among GPU agents, in KFD node order
    node: int             # KFD node id (sysfs directory name; amd-smi's node_id)
    arch: str             # gfx1100: the hardware's own, never HSA_OVERRIDE_GFX_VERSION's
    device_id: int = 0    # PCI device id (0x744c for an RX 7900 XTX)
    simd_count: int = 0
    cpu_cores: int = 0    # > 0 only on a combined CPU+GPU (APU) node
    memory_bytes: int = 0
    unique_id: int = 0    # ROCR_VISIBLE_DEVICES also accepts "GPU-<this in hex>"
    name: str = ""
    source: str = "kfd"   # kfd (sysfs) or amd-smi

    @property
    def combined_node(self) -> bool:
        """CPU cores and SIMDs on one node: how the kernel describes an APU from its ACPI CRAT table."""
        return self.cpu_cores > 0 and self.simd_count > 0

    def uuid(self) -> str:
        return f"GPU-{self.unique_id:016x}" if self.unique_id else ""

    def describe(self) -> str:
        label = f" {self.name}" if self.name and self.name != self.arch else ""
        return f"GPU {self.index} ({self.arch}{label}, PCI id 0x{self.device_id:04x}, KFD node {self.node})"


def gfx_name(version: int) -> str:
    """'gfx90a' from KFD's 90010: major * 10000 + minor * 100 + stepping, minor and stepping in hex."""
    major, minor, stepping = version // 10000, (version // 100) % 100, version % 100
    return f"gfx{major}{minor:x}{stepping:x}"


def parse_properties(text: str) -> dict[str, int]:
    """KFD's `properties` files: one 'name value' pair a line, values in decimal."""
    found = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            found[parts[0]] = int(parts[1])
    return found


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def node_memory(node_dir: Path) -> int:
    banks = sorted((node_dir / "mem_banks").glob("*/properties"))
    return sum(parse_properties(read_text(bank)).get("size_in_bytes", 0) for bank in banks)


def render_node_reachable(minor: int, dri: Path) -> bool:
    """libhsakmt leaves out a GPU whose render node it cannot open (a container given some GPUs only)."""
    if not dri.is_dir():
        return True  # nothing to judge by: count it, as a plain host would
    return (dri / f"renderD{minor}").exists()


def read_topology(nodes: Path | None = None, dri: Path | None = None) -> list[KfdGpu] | None:
    """The GPU agents in ROCr's order, or None when there is no readable KFD topology."""
    nodes, dri = nodes or KFD_NODES, dri or DRI
    try:
        ids = sorted(int(p.name) for p in nodes.iterdir() if p.name.isdigit())
    except OSError:
        return None
    gpus: list[KfdGpu] = []
    for node in ids:
        props = parse_properties(read_text(nodes / str(node) / "properties"))
        if props.get("simd_count", 0) <= 0:
            continue  # a CPU-only node: no GPU agent, no index
        if not render_node_reachable(props.get("drm_render_minor", 0), dri):
            continue
        gpus.append(KfdGpu(
            index=len(gpus), node=node, arch=gfx_name(props.get("gfx_target_version", 0)),
            device_id=props.get("device_id", 0), simd_count=props["simd_count"],
            cpu_cores=props.get("cpu_cores_count", 0), memory_bytes=node_memory(nodes / str(node)),
            unique_id=props.get("unique_id", 0), name=read_text(nodes / str(node) / "name").strip(),
        ))
    return gpus


# -------------------------------------------------------------------- amd-smi

def run_amd_smi(*args: str) -> str:
    """amd-smi's JSON for one command, '' when it is not installed or fails (it runs in its own process)."""
    exe = shutil.which("amd-smi")
    if not exe:
        return ""
    try:
        done = subprocess.run([exe, *args, "--json"], capture_output=True, text=True, timeout=AMD_SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def json_rows(text: str) -> list[dict]:
    """amd-smi prints a list of per-GPU objects; newer releases wrap it as {"gpu_data": [...]}."""
    try:
        data = json.loads(text) if text.strip() else []
    except json.JSONDecodeError:
        return []
    if isinstance(data, dict):
        data = data.get("gpu_data", [])
    return [row for row in data if isinstance(row, dict)] if isinstance(data, list) else []


def as_int(value, default: int = 0) -> int:
    """amd-smi writes numbers as 12, "0x744c" or "N/A"."""
    try:
        return int(value, 0) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        return default


def parse_amd_smi(listing: str, static: str) -> list[KfdGpu] | None:
    """GPU agents from `amd-smi list --json` (KFD node ids) and `amd-smi static --asic --json` (arch, ids).

    amd-smi numbers GPUs its own way; the KFD node id puts them back in ROCr's order.
    """
    nodes = {as_int(row.get("gpu"), -1): as_int(row.get("node_id"), -1) for row in json_rows(listing)}
    asics = {as_int(row.get("gpu"), -1): row.get("asic", {}) for row in json_rows(static)}
    if not nodes or any(node < 0 for node in nodes.values()):
        return None
    gpus = []
    for position, (gpu, node) in enumerate(sorted(nodes.items(), key=lambda item: item[1])):
        asic = asics.get(gpu) or {}
        gpus.append(KfdGpu(
            index=position, node=node, arch=str(asic.get("target_graphics_version") or "unknown").split(":")[0],
            device_id=as_int(asic.get("device_id")), name=str(asic.get("market_name") or ""),
            simd_count=as_int(asic.get("num_compute_units")), source="amd-smi",
        ))
    return gpus


def read_amd_smi() -> list[KfdGpu] | None:
    listing = run_amd_smi("list")
    return parse_amd_smi(listing, run_amd_smi("static", "--asic")) if listing else None


def list_gpus(nodes: Path | None = None, dri: Path | None = None) -> list[KfdGpu] | None:
    """KFD's topology, else amd-smi's view, else None (no AMD driver here, or nothing readable)."""
    gpus = read_topology(nodes, dri)
    return gpus if gpus is not None else read_amd_smi()


def kfd_open(fds: Path | None = None) -> bool:
    """Whether this process holds /dev/kfd: the ROCm runtime opens it when it starts, and from then on
    it has read the visibility variables, even where torch.cuda.is_initialized() still says False."""
    try:
        entries = list((fds or PROC_FDS).iterdir())
    except OSError:
        return False
    return any(link_target(fd) == KFD_DEVICE for fd in entries)


def link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:  # closed meanwhile (the listing itself held one fd)
        return ""
