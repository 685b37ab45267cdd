"""Integrated AMD GPUs hidden from HIP before it starts, simulated on the CPU.

Each machine is a small KFD topology written under tmp_path in the kernel's
format (/sys/class/kfd/kfd/topology/nodes/<n>/properties, name, mem_banks),
with the DRM render nodes libhsakmt opens, or amd-smi's JSON. The tests
check what mudpuppy sets (ROCR_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES), what
it leaves alone (anything the user set), what the plan's notes say, and when
the command restarts itself (os.execve stood in for). torch.cuda is patched
as in test_devices.py; its is_available() plays HIP's start, reading the
visibility variable the way ROCr does.
"""

from __future__ import annotations

import json
import os
import sys
import types
import warnings

import pytest
import torch
from mudpuppy.backends.torch.devices import gpu as devices, kfd, rocm, sdpa, visibility
from tests.backends.test_devices import RX_7900_XTX, STRIX_HALO, FakeProps, Machine, RAPHAEL_IGPU

VARS = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL",
        "HSA_OVERRIDE_GFX_VERSION", visibility.REEXEC_MARKER, devices.ALLOW_IGPU_VAR, sdpa.AOTRITON_GATE_VAR,
        *devices.ALLOCATOR_VARS)
GIB = 2**30

# KFD node properties as the kernel prints them (a subset of the fields; values of the real parts).
CPU = {"cpu_cores_count": 24, "simd_count": 0, "gfx_target_version": 0, "device_id": 0, "drm_render_minor": 0}
XTX = {"cpu_cores_count": 0, "simd_count": 192, "gfx_target_version": 110000, "device_id": 0x744C,
       "unique_id": 0x3A5C6E1F00D1B0E4, "vendor_id": 0x1002}
RAPHAEL = {"cpu_cores_count": 0, "simd_count": 4, "gfx_target_version": 100306, "device_id": 0x164E,
           "unique_id": 0, "vendor_id": 0x1002}
PHOENIX_780M = {"cpu_cores_count": 0, "simd_count": 24, "gfx_target_version": 110003, "device_id": 0x15BF,
                "unique_id": 0, "vendor_id": 0x1002}
STRIX_HALO_NODE = {"cpu_cores_count": 0, "simd_count": 80, "gfx_target_version": 110501, "device_id": 0x1586,
                   "unique_id": 0x51A7, "vendor_id": 0x1002}


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    """No visibility variables; KFD, render nodes and /proc/self/fd all under tmp_path; no amd-smi."""
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(kfd, "KFD_NODES", tmp_path / "nodes")
    monkeypatch.setattr(kfd, "DRI", tmp_path / "dri")
    monkeypatch.setattr(kfd, "PROC_FDS", tmp_path / "fd")
    monkeypatch.setattr(kfd.shutil, "which", lambda _name: None)
    monkeypatch.setattr(visibility, "_SET", {})
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def write_topology(tmp_path, *gpus: dict, memory=(), missing_render=()):
    """Node 0 is the CPU, then one node per GPU, each with its render node (unless listed as missing)."""
    nodes, dri = tmp_path / "nodes", tmp_path / "dri"
    dri.mkdir(exist_ok=True)
    for node, props in enumerate([CPU, *gpus]):
        folder = nodes / str(node)
        folder.mkdir(parents=True)
        minor = 127 + node if node else 0
        props = {**props, "drm_render_minor": minor}
        (folder / "properties").write_text("".join(f"{k} {v}\n" for k, v in props.items()))
        (folder / "name").write_text(kfd.gfx_name(props["gfx_target_version"]) + "\n" if node else "\n")
        if node and node - 1 < len(memory):
            bank = folder / "mem_banks" / "0"
            bank.mkdir(parents=True)
            bank.joinpath("properties").write_text(f"heap_type 1\nsize_in_bytes {memory[node - 1]}\nwidth 384\n")
        if node and node not in missing_render:
            (dri / f"renderD{minor}").touch()


class HipMachine(Machine):
    """test_devices' Machine whose GPU list is fixed when HIP starts (torch.cuda.is_available), from
    ROCR_VISIBLE_DEVICES as ROCr reads it: the physical GPUs in KFD order, the listed ones in listed order."""

    def __init__(self, monkeypatch, physical: list[FakeProps]):
        super().__init__(monkeypatch, "rocm", list(physical))
        self.physical, self.starts = physical, 0
        monkeypatch.setattr(torch.cuda, "is_available", self.start_hip)

    def start_hip(self) -> bool:
        if not self.starts:
            rocr = os.environ.get("ROCR_VISIBLE_DEVICES")
            if rocr is not None:
                self.gpus[:] = [self.physical[int(t)] for t in rocr.split(",")]
        self.starts += 1
        return bool(self.gpus)


# ------------------------------------------------------------------ reading KFD

@pytest.mark.parametrize("version, name", [
    (90010, "gfx90a"), (90402, "gfx942"), (100306, "gfx1036"), (110003, "gfx1103"), (110501, "gfx1151"),
    (120001, "gfx1201"), (90012, "gfx90c"),
])
def test_kfd_target_versions_read_as_rocm_names_them(version, name):
    assert kfd.gfx_name(version) == name


def test_gpu_agents_are_numbered_in_kfd_order_with_cpu_nodes_skipped(tmp_path):
    write_topology(tmp_path, XTX, RAPHAEL, memory=(24 * GIB, GIB // 2))
    gpus = kfd.list_gpus()
    assert [(g.index, g.node, g.arch, g.device_id) for g in gpus] == [(0, 1, "gfx1100", 0x744C),
                                                                     (1, 2, "gfx1036", 0x164E)]
    assert gpus[0].memory_bytes == 24 * GIB and gpus[1].memory_bytes == GIB // 2
    assert gpus[0].uuid() == "GPU-3a5c6e1f00d1b0e4" and gpus[1].uuid() == ""
    assert gpus[1].describe() == "GPU 1 (gfx1036, PCI id 0x164e, KFD node 2)"


def test_a_gpu_whose_render_node_is_absent_takes_no_index(tmp_path):
    """A container given only the discrete card: libhsakmt skips the iGPU, so the card is GPU 0."""
    write_topology(tmp_path, RAPHAEL, XTX, missing_render=(1,))
    assert [(g.index, g.arch) for g in kfd.list_gpus()] == [(0, "gfx1100")]
    rocm.hide_integrated_gpus()
    assert "ROCR_VISIBLE_DEVICES" not in os.environ   # nothing left to hide


def test_no_kfd_and_no_amd_smi_changes_nothing(monkeypatch):
    assert kfd.list_gpus() is None
    assert rocm.hide_integrated_gpus() == ([], "")
    machine = HipMachine(monkeypatch, [RX_7900_XTX, RAPHAEL_IGPU])
    result = rocm.probe()
    assert result.available and "visibility" not in result.details and machine.checked == [0]
    assert not any(v in os.environ for v in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"))


def test_hip_has_started_when_this_process_holds_dev_kfd(tmp_path):
    fds = tmp_path / "fd"
    fds.mkdir()
    (fds / "0").symlink_to("/dev/null")
    assert not kfd.kfd_open()
    (fds / "5").symlink_to("/dev/kfd")
    assert kfd.kfd_open()


# ------------------------------------------------------------- what is hidden

def test_discrete_card_beside_raphael_igpu_hides_it_before_hip_starts(monkeypatch, tmp_path):
    write_topology(tmp_path, XTX, RAPHAEL)
    machine = HipMachine(monkeypatch, [RX_7900_XTX, RAPHAEL_IGPU])
    result = rocm.probe()
    assert os.environ["ROCR_VISIBLE_DEVICES"] == "0"
    assert result.available and [g.name for g in result.details["gpus"]] == ["AMD Radeon RX 7900 XTX"]
    assert machine.checked == [0]
    note = result.details["visibility"][0]
    assert note.startswith("visibility: ROCR_VISIBLE_DEVICES=0 (set by mudpuppy before HIP started) hides "
                           "GPU 1 (gfx1036, PCI id 0x164e, KFD node 2): integrated GPU, Raphael")
    assert devices.ALLOW_IGPU_VAR in note and note in result.device   # `mudpuppy backends` shows it too

    plan = rocm.create(result).plan
    assert plan.device == torch.device("cuda", 0) and note in plan.notes
    assert plan.env["HIP_VISIBLE_DEVICES"] == "0"
    child = devices.child_environment(plan, os.environ)
    assert child["ROCR_VISIBLE_DEVICES"] == "0" and child["HIP_VISIBLE_DEVICES"] == "0"

    again = rocm.probe()   # a second probe in the same process knows the value is mudpuppy's
    assert again.details["visibility"] == [note.replace("set by mudpuppy before HIP started", "set by mudpuppy")]
    assert os.environ["ROCR_VISIBLE_DEVICES"] == "0"


def test_igpu_enumerated_first_leaves_the_card_at_its_own_index(monkeypatch, tmp_path):
    write_topology(tmp_path, RAPHAEL, XTX)
    HipMachine(monkeypatch, [RAPHAEL_IGPU, RX_7900_XTX])
    plan = rocm.create(rocm.probe()).plan
    assert os.environ["ROCR_VISIBLE_DEVICES"] == "1"
    assert plan.device == torch.device("cuda", 0) and plan.env["HIP_VISIBLE_DEVICES"] == "0"


def test_overridden_780m_is_still_found_by_the_kernels_architecture(monkeypatch, tmp_path):
    """With HSA_OVERRIDE_GFX_VERSION=11.0.0 HIP calls the 780M gfx1100, like the card beside it."""
    monkeypatch.setenv("HSA_OVERRIDE_GFX_VERSION", "11.0.0")
    write_topology(tmp_path, PHOENIX_780M, XTX)
    overridden = FakeProps("AMD Radeon 780M", "gfx1100", 11, 0, 4)
    machine = HipMachine(monkeypatch, [overridden, RX_7900_XTX])
    result = rocm.probe()
    assert os.environ["ROCR_VISIBLE_DEVICES"] == "1" and machine.gpus == [RX_7900_XTX]
    note = result.details["visibility"][0]
    assert "integrated GPU, Phoenix / Hawk Point" in note
    assert "HSA_OVERRIDE_GFX_VERSION=11.0.0 makes HIP report another architecture, the kernel reads gfx1103" in note


@pytest.mark.parametrize("node, why", [
    # An architecture no table knows, on a node holding CPU cores too: how the kernel describes an APU.
    ({"cpu_cores_count": 8, "simd_count": 16, "gfx_target_version": 110600, "device_id": 0x1999},
     "integrated GPU (its KFD node holds the CPU cores too)"),
    # The architecture unreadable (0), the PCI id a known iGPU's.
    ({"cpu_cores_count": 0, "simd_count": 4, "gfx_target_version": 0, "device_id": 0x13C0},
     "integrated GPU, Granite Ridge"),
])
def test_an_igpu_is_also_recognised_by_its_apu_properties(tmp_path, node, why):
    write_topology(tmp_path, XTX, node)
    notes, problem = rocm.hide_integrated_gpus()
    assert problem == "" and os.environ["ROCR_VISIBLE_DEVICES"] == "0" and why in notes[0]


def test_strix_halo_alone_is_the_accelerator_and_nothing_is_hidden(monkeypatch, tmp_path):
    write_topology(tmp_path, STRIX_HALO_NODE)
    HipMachine(monkeypatch, [STRIX_HALO])
    result = rocm.probe()
    assert result.available and "visibility" not in result.details
    assert "ROCR_VISIBLE_DEVICES" not in os.environ


def test_only_an_igpu_is_not_hidden_and_the_survey_explains(monkeypatch, tmp_path):
    write_topology(tmp_path, RAPHAEL)
    HipMachine(monkeypatch, [RAPHAEL_IGPU])
    result = rocm.probe()
    assert not result.available and "ROCR_VISIBLE_DEVICES" not in os.environ
    assert devices.ALLOW_IGPU_VAR in result.reason


def test_opting_in_to_the_igpu_hides_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv(devices.ALLOW_IGPU_VAR, "1")
    write_topology(tmp_path, XTX, RAPHAEL)
    assert rocm.hide_integrated_gpus() == ([], "") and "ROCR_VISIBLE_DEVICES" not in os.environ


# ------------------------------------------------------------ the user's choice

@pytest.mark.parametrize("var", ["HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL"])
def test_a_hip_visibility_the_user_set_is_left_exactly_as_it_is(monkeypatch, tmp_path, var):
    monkeypatch.setenv(var, "0,1")
    write_topology(tmp_path, XTX, RAPHAEL)
    before = dict(os.environ)
    notes, problem = rocm.hide_integrated_gpus()
    assert dict(os.environ) == before and problem == ""
    assert notes == [f"visibility: {var}=0,1 set by you; mudpuppy hides no GPU"]


def test_hiding_counts_within_the_users_rocr_visible_devices(monkeypatch, tmp_path):
    """ROCR_VISIBLE_DEVICES=2,0 shows HIP the Raphael iGPU as device 0 and the card as device 1."""
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "2,0")
    write_topology(tmp_path, XTX, STRIX_HALO_NODE, RAPHAEL)
    notes, _ = rocm.hide_integrated_gpus()
    assert os.environ["ROCR_VISIBLE_DEVICES"] == "2,0" and os.environ["HIP_VISIBLE_DEVICES"] == "1"
    assert notes[0].startswith("visibility: HIP_VISIBLE_DEVICES=1 (set by mudpuppy before HIP started) hides GPU 2")


def test_rocr_visible_devices_by_uuid_and_already_without_the_igpu(monkeypatch, tmp_path):
    write_topology(tmp_path, XTX, RAPHAEL)
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "GPU-3A5C6E1F00D1B0E4")
    assert rocm.hide_integrated_gpus() == ([], "") and "HIP_VISIBLE_DEVICES" not in os.environ
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "GPU-ffff")
    notes, _ = rocm.hide_integrated_gpus()
    assert "not matched to the KFD topology" in notes[0] and "HIP_VISIBLE_DEVICES" not in os.environ


# ------------------------------------------------------------------ amd-smi

# `amd-smi list --json` and `amd-smi static --asic --json` in the shape amd-smi prints (ROCm 6.x / 7.x):
# amd-smi numbers GPUs by PCI address, so the iGPU (bus 0x7a... here 0x12) can come before the card.
AMD_SMI_LIST = json.dumps([
    {"gpu": 0, "bdf": "0000:12:00.0", "uuid": "00ff164e-0000-1000-8000-000000000000", "kfd_id": 11224,
     "node_id": 2, "partition_id": 0},
    {"gpu": 1, "bdf": "0000:03:00.0", "uuid": "e4ff744c-0000-1000-80d1-b0e43a5c6e1f", "kfd_id": 45412,
     "node_id": 1, "partition_id": 0},
])
AMD_SMI_STATIC = json.dumps({"gpu_data": [
    {"gpu": 0, "asic": {"market_name": "AMD Radeon Graphics", "vendor_id": "0x1002", "device_id": "0x164e",
                        "rev_id": "0xc1", "num_compute_units": 2, "target_graphics_version": "gfx1036"}},
    {"gpu": 1, "asic": {"market_name": "Radeon RX 7900 XTX", "vendor_id": "0x1002", "device_id": "0x744c",
                        "rev_id": "0xc8", "num_compute_units": 96, "target_graphics_version": "gfx1100"}},
]})


def test_amd_smi_output_is_put_back_in_kfd_order():
    gpus = kfd.parse_amd_smi(AMD_SMI_LIST, AMD_SMI_STATIC)
    assert [(g.index, g.node, g.arch, g.device_id, g.name) for g in gpus] == [
        (0, 1, "gfx1100", 0x744C, "Radeon RX 7900 XTX"), (1, 2, "gfx1036", 0x164E, "AMD Radeon Graphics")]
    assert kfd.parse_amd_smi("", AMD_SMI_STATIC) is None and kfd.parse_amd_smi("not json", "") is None


def test_without_kfd_in_sysfs_amd_smi_decides(monkeypatch):
    answers = {("list",): AMD_SMI_LIST, ("static", "--asic"): AMD_SMI_STATIC}
    monkeypatch.setattr(kfd, "run_amd_smi", lambda *args: answers[args])
    notes, _ = rocm.hide_integrated_gpus()
    assert os.environ["ROCR_VISIBLE_DEVICES"] == "0"
    assert "GPU 1 (gfx1036 AMD Radeon Graphics, PCI id 0x164e, KFD node 2)" in notes[0]


# --------------------------------------------------------- HIP already started

class Restarted(Exception):
    pass


def fake_execve(calls):
    def execve(path, argv, env):
        calls.append((path, argv, env))
        raise Restarted  # the real one never returns
    return execve


def test_the_command_restarts_itself_once_when_hip_had_started(monkeypatch, tmp_path):
    write_topology(tmp_path, XTX, RAPHAEL)
    HipMachine(monkeypatch, [RX_7900_XTX, RAPHAEL_IGPU])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(visibility, "started_from_cli", lambda: True)
    calls = []
    monkeypatch.setattr(visibility.os, "execve", fake_execve(calls))
    with pytest.raises(Restarted):
        rocm.probe()
    (path, argv, env), = calls
    assert path == sys.executable and argv == [sys.executable, *sys.orig_argv[1:]]
    assert env["ROCR_VISIBLE_DEVICES"] == "0" and env[visibility.REEXEC_MARKER] == "ROCR_VISIBLE_DEVICES=0"
    assert "ROCR_VISIBLE_DEVICES" not in os.environ   # this process is replaced, not changed

    # The restarted process: the variable and the marker in its environment, HIP not yet started.
    os.environ.update({k: env[k] for k in ("ROCR_VISIBLE_DEVICES", visibility.REEXEC_MARKER)})
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    notes, problem = rocm.hide_integrated_gpus()
    assert problem == "" and len(calls) == 1 and "(restarted once to set it before HIP started)" in notes[0]



def test_a_second_restart_never_happens(monkeypatch, tmp_path):
    write_topology(tmp_path, XTX, RAPHAEL)
    monkeypatch.setenv(visibility.REEXEC_MARKER, "ROCR_VISIBLE_DEVICES=0")  # restarted, yet HIP started early
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    calls = []
    decision = visibility.decide(kfd.list_gpus(), rocm.igpu_reason, os.environ)
    problem = visibility.apply(decision, True, devices.ALLOW_IGPU_VAR, from_cli=True, execve=fake_execve(calls))
    assert calls == [] and "ROCR_VISIBLE_DEVICES=0" in problem


def test_inside_a_python_session_the_error_says_what_to_set(monkeypatch, tmp_path):
    write_topology(tmp_path, XTX, RAPHAEL)
    fds = tmp_path / "fd"
    fds.mkdir()
    (fds / "7").symlink_to("/dev/kfd")   # HIP started, though torch.cuda.is_initialized() says no
    HipMachine(monkeypatch, [RX_7900_XTX, RAPHAEL_IGPU])
    calls = []
    monkeypatch.setattr(visibility.os, "execve", fake_execve(calls))
    result = rocm.probe()   # pytest is __main__ here: a library call, not the mudpuppy command
    assert not result.available and calls == []
    assert "HIP had already started in this process with an integrated GPU visible" in result.reason
    assert "Set ROCR_VISIBLE_DEVICES=0 in the environment before Python starts" in result.reason
    assert devices.ALLOW_IGPU_VAR in result.reason and "ROCR_VISIBLE_DEVICES" not in os.environ


def test_the_mudpuppy_command_is_told_apart_from_a_users_python(monkeypatch):
    assert not visibility.started_from_cli()
    as_module = types.ModuleType("__main__")
    as_module.__spec__ = types.SimpleNamespace(name="mudpuppy.__main__")
    monkeypatch.setitem(sys.modules, "__main__", as_module)
    assert visibility.started_from_cli()
    script = types.ModuleType("__main__")   # the console script pip writes: `from mudpuppy.cli import main`
    script.main = types.SimpleNamespace(__module__="mudpuppy.cli")
    monkeypatch.setitem(sys.modules, "__main__", script)
    assert visibility.started_from_cli()


# ------------------------------------------------------------------ attention

def fake_chooser(monkeypatch, kernel: str, warn: bool):
    from torch.nn.attention import SDPBackend

    def choose(*_args):
        if warn:
            warnings.warn("Flash Efficient attention on Current AMD GPU is still experimental. "
                          "Enable it with TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1.", UserWarning)
        return getattr(SDPBackend, kernel).value

    monkeypatch.setattr(torch, "_fused_sdp_choice", choose)
    monkeypatch.setattr(sdpa, "device_arch", lambda _device: "gfx1100")


def test_rdna3_attention_report_says_math_runs_and_what_enables_flash(monkeypatch):
    fake_chooser(monkeypatch, "MATH", warn=True)
    report = sdpa.attention_report("cpu", torch.bfloat16)
    assert report["causal"] == "math" and report["aotriton_gate"] == "gated"
    text = sdpa.describe_attention(report)
    assert text.startswith("sdpa: math kernel for causal batches, math for padded/packed (bfloat16); ")
    assert "experimental on gfx1100 and off: set TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1" in text


def test_rdna3_attention_with_the_gate_lifted(monkeypatch):
    monkeypatch.setenv(sdpa.AOTRITON_GATE_VAR, "1")
    fake_chooser(monkeypatch, "FLASH_ATTENTION", warn=False)
    text = devices.report_attention(torch.device("cpu"), torch.bfloat16)
    assert text.startswith("sdpa: flash kernel for causal batches")
    assert text.endswith("AOTriton's experimental kernels for gfx1100, enabled by "
                         "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1")


@pytest.mark.parametrize("arch, warned, kernel, env, expected", [
    ("gfx1100", False, "math", {}, "gated"),          # torch's once-per-process warning already spent
    ("gfx1100", False, "math", {"TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL": "true"}, "gated"),  # torch wants "1"
    ("gfx942", False, "flash", {}, ""),               # MI300: not gated
    ("gfx1100", False, "math", {"TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL": "1"}, ""),  # lifted, math for
                                                                                      # another reason
    ("gfx1201", True, "math", {}, "gated"),           # torch said so: believed for any architecture
    ("", False, "math", {}, ""),                      # CPU or CUDA
])
def test_aotriton_gate_cases(arch, warned, kernel, env, expected):
    assert sdpa.aotriton_gate(arch, warned, kernel, env) == expected


def test_cpu_attention_report_has_no_gate():
    report = sdpa.attention_report("cpu", torch.float32)
    assert report["arch"] == "" and report["aotriton_gate"] == ""


def test_cli_backends_says_what_was_hidden(monkeypatch, tmp_path):
    from click.testing import CliRunner
    from mudpuppy.cli import main

    write_topology(tmp_path, XTX, RAPHAEL)
    HipMachine(monkeypatch, [RX_7900_XTX, RAPHAEL_IGPU])
    out = CliRunner().invoke(main, ["backends"]).output
    assert "available  cuda:0 (AMD Radeon RX 7900 XTX, gfx1100, 24 GiB, bf16) with HIP" in out
    assert "visibility: ROCR_VISIBLE_DEVICES=0 (set by mudpuppy before HIP started) hides GPU 1 (gfx1036" in out
    assert "cuda:1" not in out   # torch never saw the iGPU
