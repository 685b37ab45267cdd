"""ROCm and CUDA device handling, simulated on the CPU by patching torch's device queries.

Each situation people hit on real machines (a discrete card next to an iGPU, a
GPU without bf16, the wrong torch build, no GPU, user-set visibility and
allocator variables) is staged here, and each test asserts what mudpuppy
chose: device, dtype, environment and load path. The probe's allocation is
replaced, so nothing is ever allocated on a fake 'cuda' device.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch
from click.testing import CliRunner
from mudpuppy import create_backend
from mudpuppy.backends import factory
from mudpuppy.backends.torch.devices import cuda, fp8_training, gpu as devices, rocm
from mudpuppy.backends.torch.backend import DevicePlan, TorchBackend
from mudpuppy.errors import BackendUnavailable, MudpuppyError

HIP = "7.2.53211-e0a5e2e8b"
VISIBILITY = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


class FakeProps:
    """The fields of torch.cuda.get_device_properties() that mudpuppy reads."""

    def __init__(self, name, arch="", major=0, minor=0, memory_gib=16, integrated=False):
        self.name, self.gcnArchName = name, arch
        self.major, self.minor = major, minor
        self.total_memory = int(memory_gib * 2**30)
        self.is_integrated = int(integrated)


RX_7900_XTX = FakeProps("AMD Radeon RX 7900 XTX", "gfx1100", 11, 0, 24)
RAPHAEL_IGPU = FakeProps("AMD Radeon Graphics", "gfx1036", 10, 3, 2, integrated=True)
RX_6800 = FakeProps("AMD Radeon RX 6800", "gfx1030", 10, 3, 16)
MI210 = FakeProps("AMD Instinct MI210", "gfx90a:sramecc+:xnack-", 9, 0, 64)
STRIX_HALO = FakeProps("AMD Radeon 8060S", "gfx1151", 11, 5, 96, integrated=True)
RTX_4090 = FakeProps("NVIDIA GeForce RTX 4090", major=8, minor=9, memory_gib=24)
RTX_3090 = FakeProps("NVIDIA GeForce RTX 3090", major=8, minor=6, memory_gib=24)
TESLA_T4 = FakeProps("Tesla T4", major=7, minor=5, memory_gib=16)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """Every test starts without GPU variables and leaves os.environ as it found it."""
    for var in (*devices.ALLOCATOR_VARS, *VISIBILITY, devices.ALLOW_IGPU_VAR):
        monkeypatch.delenv(var, raising=False)
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


class Machine:
    """A simulated torch build and its GPUs; records which GPUs the probe touched."""

    def __init__(self, monkeypatch, build: str, gpus: list[FakeProps], failing: dict[int, str] | None = None):
        self.gpus, self.failing, self.checked, self.current = gpus, failing or {}, [], []
        monkeypatch.setattr(torch.version, "hip", HIP if build == "rocm" else None)
        monkeypatch.setattr(torch.version, "cuda", "12.8" if build == "cuda" else None)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(gpus))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpus[i])
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: gpus[i].name)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # ROCm's answer; never trusted
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
        monkeypatch.setattr(torch.cuda, "set_device", self.current.append)
        monkeypatch.setattr(devices, "check_gpu", self.check)
        monkeypatch.setattr(devices, "attention_report", self.attention)

    current: list  # every device made current (torch.cuda.set_device), in order

    def check(self, index: int) -> str:
        self.checked.append(index)
        if index in self.failing:
            raise RuntimeError(self.failing[index])
        return ""

    @staticmethod
    def attention(device, dtype=None, **_):
        return {"device": str(device), "dtype": str(dtype).replace("torch.", ""),
                "causal": "flash", "masked": "memory-efficient"}


def forbid_device_queries(monkeypatch):
    """A wrong-build message must come before torch is asked anything about GPUs."""
    def refuse(*_a, **_k):
        raise AssertionError("torch.cuda was queried on a mismatched build")

    for name in ("is_available", "device_count", "get_device_properties", "get_device_name"):
        monkeypatch.setattr(torch.cuda, name, refuse)


# ----------------------------------------------------------------------- ROCm

def test_rocm_discrete_card_with_igpu_skips_the_igpu_without_touching_it(monkeypatch):
    machine = Machine(monkeypatch, "rocm", [RX_7900_XTX, RAPHAEL_IGPU])
    result = rocm.probe()
    assert result.available
    assert machine.checked == [0]  # the iGPU segfaults on first use, so it is never probed
    skipped = result.details["gpus"][1]
    assert "integrated GPU" in skipped.problem and devices.ALLOW_IGPU_VAR in skipped.problem
    assert result.details["usable"] == [0]

    backend = rocm.create(result)
    plan = backend.plan
    assert plan.device == torch.device("cuda", 0) and backend.device == "cuda:0"
    assert plan.autocast_dtype is torch.bfloat16 and plan.precision == "bf16" and not plan.loss_scaling
    # Children see only the discrete card, whichever variable their runtime reads.
    assert plan.env["HIP_VISIBLE_DEVICES"] == "0" and plan.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert plan.env["PYTORCH_HIP_ALLOC_CONF"] == "max_split_size_mb:128"
    assert os.environ["PYTORCH_HIP_ALLOC_CONF"] == "max_split_size_mb:128"
    assert "HIP_VISIBLE_DEVICES" not in os.environ  # this process keeps torch's numbering
    assert any("never device_map='auto'" in n for n in plan.notes)
    assert any(n.startswith("cuda:1 (AMD Radeon Graphics") and "skipped: integrated" in n for n in plan.notes)


def test_rocm_igpu_enumerated_first_sends_training_to_the_discrete_card(monkeypatch):
    machine = Machine(monkeypatch, "rocm", [RAPHAEL_IGPU, RX_7900_XTX])
    plan = rocm.create(rocm.probe()).plan
    assert machine.checked == [1]
    assert plan.device == torch.device("cuda", 1) and plan.devices == [1]
    assert plan.env["HIP_VISIBLE_DEVICES"] == "1" and plan.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert devices.child_environment(plan, {"PATH": "/bin"}) == {"PATH": "/bin", **plan.env}


def test_rocm_igpu_is_refused_when_picked_unless_the_user_opts_in(monkeypatch):
    machine = Machine(monkeypatch, "rocm", [RX_7900_XTX, RAPHAEL_IGPU])
    with pytest.raises(BackendUnavailable, match=r"devices: \[1\] cannot be used.*integrated GPU"):
        rocm.create(rocm.probe(), devices=[1])
    monkeypatch.setenv(devices.ALLOW_IGPU_VAR, "1")
    machine.checked.clear()
    plan = rocm.create(rocm.probe(), devices=[1]).plan
    assert machine.checked == [0, 1]
    assert plan.device == torch.device("cuda", 1)
    assert plan.precision == "fp16" and plan.loss_scaling  # gfx1036 has no native bf16


def test_rocm_only_an_igpu_is_unavailable_and_says_how_to_try_it(monkeypatch):
    Machine(monkeypatch, "rocm", [RAPHAEL_IGPU])
    result = rocm.probe()
    assert not result.available
    assert "no usable GPU among 1" in result.reason and "gfx1036" in result.reason
    assert devices.ALLOW_IGPU_VAR in result.reason


def test_strix_halo_apu_is_a_real_accelerator_and_is_kept(monkeypatch):
    machine = Machine(monkeypatch, "rocm", [STRIX_HALO])
    plan = rocm.create(rocm.probe()).plan
    assert machine.checked == [0]
    assert plan.device == torch.device("cuda", 0) and plan.precision == "bf16"


def test_a_gpu_that_fails_the_real_probe_is_skipped_with_the_error(monkeypatch):
    Machine(monkeypatch, "rocm", [MI210, MI210], failing={0: "HIP error: invalid device function\nmore"})
    result = rocm.probe()
    assert result.details["gpus"][0].problem == "probe failed: HIP error: invalid device function"
    plan = rocm.create(result).plan
    assert plan.device == torch.device("cuda", 1)


def test_bf16_less_gpu_trains_in_fp16_with_loss_scaling(monkeypatch):
    Machine(monkeypatch, "rocm", [RX_6800])
    result = rocm.probe()
    plan = rocm.create(result).plan
    assert plan.autocast_dtype is torch.float16 and plan.precision == "fp16" and plan.loss_scaling
    assert any("no native bf16" in n and "loss scaling" in n for n in plan.notes)
    with pytest.raises(BackendUnavailable, match="precision: bf16 .*gfx1030.*precision: fp16"):
        rocm.create(result, precision="bf16")
    assert rocm.create(result, precision="fp32").plan.autocast_dtype is None


def test_rocm_arch_flags_are_stripped_and_cdna_has_bf16(monkeypatch):
    Machine(monkeypatch, "rocm", [MI210])
    gpu = rocm.probe().details["gpus"][0]
    assert gpu.arch == "gfx90a" and gpu.bf16 and not gpu.fp8


# ----------------------------------------------------------------------- CUDA

def test_cuda_build_picks_bf16_and_sets_only_cuda_variables(monkeypatch):
    machine = Machine(monkeypatch, "cuda", [RTX_4090])
    result = cuda.probe()
    assert result.available and machine.checked == [0]
    assert "sm_89" in result.device and "CUDA 12.8" in result.device
    plan = cuda.create(result).plan
    assert plan.name == "cuda" and plan.device == torch.device("cuda", 0)
    assert plan.autocast_dtype is torch.bfloat16 and not plan.loss_scaling
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "0" and "HIP_VISIBLE_DEVICES" not in plan.env
    expected = "expandable_segments:True" if sys.platform.startswith("linux") else "max_split_size_mb:128"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == expected == os.environ["PYTORCH_ALLOC_CONF"]
    assert "PYTORCH_HIP_ALLOC_CONF" not in os.environ


def test_pre_ampere_nvidia_gpu_trains_in_fp16_with_loss_scaling(monkeypatch):
    Machine(monkeypatch, "cuda", [TESLA_T4])
    plan = cuda.create(cuda.probe()).plan
    assert plan.autocast_dtype is torch.float16 and plan.loss_scaling


def test_cuda_visible_devices_uuids_are_carried_to_children(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    Machine(monkeypatch, "cuda", [RTX_3090, RTX_4090])
    plan = cuda.create(cuda.probe(), devices=[1]).plan
    assert plan.device == torch.device("cuda", 1)
    assert plan.env == {"CUDA_VISIBLE_DEVICES": "GPU-bbbb", "PYTORCH_CUDA_ALLOC_CONF": plan.env["PYTORCH_CUDA_ALLOC_CONF"]}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa,GPU-bbbb"


def test_optional_kernels_are_reported_never_required(monkeypatch):
    Machine(monkeypatch, "cuda", [RTX_4090])
    real_version = devices.importlib.metadata.version
    fake = {"bitsandbytes": "0.50.2", "flash-attn": "2.8.3"}

    def version(dist):
        return fake[dist] if dist in fake else real_version(dist)

    monkeypatch.setattr(devices.importlib.metadata, "version", version)
    result = cuda.probe()
    assert result.details["optional"] == {"bitsandbytes": "0.50.2", "flash_attn": "2.8.3"}
    plan = cuda.create(result).plan
    assert any("bitsandbytes 0.50.2" in n and "flash_attn 2.8.3" in n for n in plan.notes)
    assert "sdpa" in plan.attention  # SDPA stays the attention path either way


# -------------------------------------------------------- wrong builds, no GPU

def test_rocm_backend_on_a_cuda_build_explains_the_difference(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    forbid_device_queries(monkeypatch)
    result = rocm.probe()
    assert not result.available
    assert "has no HIP support" in result.reason and "CUDA build (CUDA 12.8)" in result.reason
    assert "NVIDIA GPUs only" in result.reason and "--backend cuda" in result.reason
    assert f"pip install torch --index-url {rocm.ROCM_WHEEL_INDEX}" in result.reason


def test_cuda_backend_on_a_rocm_build_explains_the_difference(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", HIP)
    monkeypatch.setattr(torch.version, "cuda", None)
    forbid_device_queries(monkeypatch)
    result = cuda.probe()
    assert not result.available
    assert f"ROCm build (HIP {HIP})" in result.reason and "--backend rocm" in result.reason
    assert "cannot drive NVIDIA GPUs" in result.reason
    assert f"pip uninstall -y torch && pip install torch --index-url {cuda.CUDA_WHEEL_INDEX}" in result.reason
    with pytest.raises(BackendUnavailable, match="cuda: this torch build .* is the ROCm build"):
        create_backend("cuda")


def test_gpu_backends_on_the_cpu_build_name_the_build_and_the_install_command(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", None)
    forbid_device_queries(monkeypatch)
    for module, index in ((rocm, rocm.ROCM_WHEEL_INDEX), (cuda, cuda.CUDA_WHEEL_INDEX)):
        reason = module.probe().reason
        assert f"({torch.__version__})" in reason and "CPU-only build" in reason
        assert f"pip install torch --index-url {index}" in reason


def test_no_gpu_at_all_names_the_checks_and_auto_falls_back_to_cpu(monkeypatch):
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    Machine(monkeypatch, "rocm", [])
    result = rocm.probe()
    assert not result.available
    assert f"HIP {HIP} but sees no AMD GPU" in result.reason
    assert "render and video groups" in result.reason and "HIP_VISIBLE_DEVICES=''" in result.reason
    assert "PYTORCH_HIP_ALLOC_CONF" not in os.environ  # nothing is set up for a GPU that is not there
    assert create_backend("auto").name == "cpu"
    with pytest.raises(BackendUnavailable, match="rocm: torch .* sees no AMD GPU"):
        create_backend("rocm")


# ------------------------------------------------------------------ visibility

def test_user_set_hip_visible_devices_is_respected_and_passed_on(monkeypatch):
    # The user hid the iGPU themselves: torch sees one GPU, the driver's number 1.
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    Machine(monkeypatch, "rocm", [RX_7900_XTX])
    plan = rocm.create(rocm.probe()).plan
    assert plan.device == torch.device("cuda", 0)
    assert plan.env["HIP_VISIBLE_DEVICES"] == "1" and plan.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert os.environ["HIP_VISIBLE_DEVICES"] == "1"


def test_rocr_visible_devices_is_left_alone_and_hip_indices_stay_relative_to_it(monkeypatch):
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "2,3")
    Machine(monkeypatch, "rocm", [MI210, MI210])
    plan = rocm.create(rocm.probe(), devices=[1]).plan
    assert plan.env["HIP_VISIBLE_DEVICES"] == "1" and "ROCR_VISIBLE_DEVICES" not in plan.env
    assert devices.child_environment(plan)["ROCR_VISIBLE_DEVICES"] == "2,3"


# ------------------------------------------------------------------- selection

def test_explicit_device_selection_and_its_errors(monkeypatch):
    Machine(monkeypatch, "rocm", [MI210, MI210])
    result = rocm.probe()
    assert rocm.create(result, devices=[1]).plan.device == torch.device("cuda", 1)
    assert rocm.create(result, devices=1).plan.device == torch.device("cuda", 1)
    with pytest.raises(BackendUnavailable, match=r"devices: \[5\] is not a GPU torch can see; indices run 0\.\.1"):
        rocm.create(result, devices=[5])
    with pytest.raises(BackendUnavailable, match="one GPU per run for now"):
        rocm.create(result, devices=[0, 1])
    with pytest.raises(BackendUnavailable, match="precision: 'fp64' is not one of"):
        rocm.create(result, precision="fp64")


def test_the_chosen_gpu_is_made_current(monkeypatch):
    machine = Machine(monkeypatch, "rocm", [MI210, MI210])
    rocm.create(rocm.probe(), devices=[1])
    assert machine.current == [torch.device("cuda", 1)]


@pytest.mark.parametrize("local_rank, gpu", [(0, 1), (1, 2)])
def test_each_rank_probes_and_binds_only_its_own_gpu(monkeypatch, local_rank, gpu):
    """Under torchrun, rank i trains on the i-th usable GPU: only that GPU is allocated on (N contexts for N
    ranks, not N x N), and it is made current, so NCCL, torchao's streams and torch.cuda calls without a
    device do not all land on cuda:0."""
    machine = Machine(monkeypatch, "rocm", [RAPHAEL_IGPU, MI210, MI210])
    for var, value in (("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"), ("RANK", str(local_rank)),
                       ("LOCAL_RANK", str(local_rank))):
        monkeypatch.setenv(var, value)
    result = rocm.probe()
    assert result.available and machine.checked == []
    plan = devices.plan_run(rocm.KIND, result)
    assert plan.device == torch.device("cuda", gpu)
    assert machine.checked == [gpu] and machine.current == [torch.device("cuda", gpu)]


def test_a_rank_whose_gpu_fails_the_probe_says_which(monkeypatch):
    Machine(monkeypatch, "cuda", [RTX_4090, RTX_4090], failing={1: "CUDA error: an illegal memory access"})
    for var, value in (("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(var, value)
    with pytest.raises(BackendUnavailable, match="cuda:1, local rank 1's GPU, cannot be used: probe failed: CUDA error"):
        devices.plan_run(cuda.KIND, cuda.probe())


def test_the_process_group_is_bound_to_the_ranks_gpu(monkeypatch):
    from mudpuppy.backends.torch import distributed as torch_distributed

    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch_distributed, "joined", lambda: False)
    monkeypatch.setattr(torch_distributed.atexit, "register", lambda fn: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch_distributed.dist, "init_process_group", lambda **kw: seen.update(kw))
    torch_distributed.join("cuda", None)
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 1)
    torch_distributed.join("cpu", None)
    assert seen["backend"] == "gloo" and seen["device_id"] is None


@pytest.mark.parametrize("make", [cuda, rocm])
def test_a_low_bit_optimizer_is_checked_where_its_update_runs(monkeypatch, make):
    """With optimizer offload the update runs on the host: the CPU's toolchain is what it needs."""
    from mudpuppy.backends.torch import optimizers
    from mudpuppy.config import MemoryConfig

    Machine(monkeypatch, "cuda" if make is cuda else "rocm", [MI210])
    asked = []
    monkeypatch.setattr(optimizers, "low_bit_problem", lambda name, device: asked.append(device) or "no")
    for memory, where in ((None, "cuda"), (MemoryConfig(optimizer_offload=True), "cpu")):
        with pytest.raises(MudpuppyError, match="adamw_8bit"):
            make.create(make.probe(), memory=memory, optimizer="adamw_8bit")
        assert asked[-1] == where


def test_create_backend_passes_device_options_through(monkeypatch):
    Machine(monkeypatch, "rocm", [MI210, MI210])
    backend = create_backend("rocm", devices=[1], precision="fp16")
    assert backend.device == "cuda:1" and backend.plan.loss_scaling


# ------------------------------------------------------------------- allocator

def test_allocator_default_is_set_before_the_probe_allocates(monkeypatch):
    machine = Machine(monkeypatch, "rocm", [MI210])
    seen = []
    monkeypatch.setattr(devices, "check_gpu", lambda i: seen.append(os.environ.get("PYTORCH_HIP_ALLOC_CONF")) or "")
    result = rocm.probe()
    assert seen == ["max_split_size_mb:128"]
    assert os.environ["PYTORCH_ALLOC_CONF"] == "max_split_size_mb:128"
    assert result.details["allocator"]["source"] == "mudpuppy"
    assert "allocator: PYTORCH_HIP_ALLOC_CONF=max_split_size_mb:128 (mudpuppy default)" in result.device
    assert machine.checked == []


def test_a_second_probe_knows_the_default_is_mudpuppys_own(monkeypatch):
    Machine(monkeypatch, "rocm", [MI210])
    rocm.probe()
    again = rocm.probe().details["allocator"]
    assert again["source"] == "mudpuppy" and again["value"] == "max_split_size_mb:128"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:512")  # the user changes it: theirs now
    assert rocm.probe().details["allocator"]["source"] == "user"


def test_user_allocator_setting_is_kept_and_reported(monkeypatch):
    monkeypatch.setenv("PYTORCH_HIP_ALLOC_CONF", "garbage_collection_threshold:0.8")
    Machine(monkeypatch, "rocm", [RX_7900_XTX])
    result = rocm.probe()
    assert os.environ["PYTORCH_HIP_ALLOC_CONF"] == "garbage_collection_threshold:0.8"
    assert "PYTORCH_ALLOC_CONF" not in os.environ
    plan = rocm.create(result).plan
    assert plan.env["PYTORCH_HIP_ALLOC_CONF"] == "garbage_collection_threshold:0.8"
    assert any("PYTORCH_HIP_ALLOC_CONF=garbage_collection_threshold:0.8 (set by you)" in n for n in plan.notes)


def test_rocm_expandable_segments_are_checked_against_the_versions(monkeypatch):
    assert rocm.expandable_segments_supported("2.11.0+rocm7.0", "7.0.51831")
    assert not rocm.expandable_segments_supported("2.10.0+rocm7.0", "7.0.51831")
    assert not rocm.expandable_segments_supported("2.12.0+rocm6.4", "6.4.43482")
    monkeypatch.setattr(torch.version, "hip", "6.4.43482-0f2d60242")
    assert "ignored by torch" in rocm.allocator_notes("expandable_segments:True")[0]
    monkeypatch.setattr(torch, "__version__", "2.13.0+rocm7.2")
    monkeypatch.setattr(torch.version, "hip", HIP)
    assert "zeroed memory" in rocm.allocator_notes("expandable_segments:True,max_split_size_mb:256")[0]
    assert rocm.allocator_notes("max_split_size_mb:256") == []


def test_torch_reads_the_allocator_variable_set_after_import():
    """The default only works if torch parses the variable lazily; checked on this torch, in a clean process."""
    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        pytest.skip("this torch cannot report its allocator settings")
    code = ("import torch\n"
            "from mudpuppy.backends.torch.devices import gpu as devices, rocm\n"
            "devices.set_allocator_defaults(rocm.KIND)\n"
            "print(torch._C._accelerator_getAllocatorSettings())\n")
    env = {k: v for k, v in os.environ.items() if k not in devices.ALLOCATOR_VARS}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "max_split_size_mb:128"


# ------------------------------------------------------------------- precision

def test_fp8_is_explicit_and_refused_where_the_hardware_lacks_it(monkeypatch):
    Machine(monkeypatch, "cuda", [RTX_3090, RTX_4090])
    result = cuda.probe()
    with pytest.raises(BackendUnavailable, match=r"fp8 is not supported on cuda:0 .*sm_86.*capability 8\.9"):
        cuda.create(result, precision="fp8")
    real_version = devices.importlib.metadata.version

    def no_torchao(dist):
        if dist == "torchao":
            raise devices.importlib.metadata.PackageNotFoundError(dist)
        return real_version(dist)

    monkeypatch.setattr(devices.importlib.metadata, "version", no_torchao)
    with pytest.raises(BackendUnavailable, match="pip install torchao"):
        cuda.create(result, devices=[1], precision="fp8")
    monkeypatch.setattr(devices.importlib.metadata, "version", lambda dist: "0.14.0")
    plan = cuda.create(result, devices=[1], precision="fp8").plan
    assert plan.fp8 and plan.autocast_dtype is torch.bfloat16


def test_fp8_on_rocm_names_the_gpus_that_have_it(monkeypatch):
    Machine(monkeypatch, "rocm", [RX_7900_XTX, FakeProps("AMD Instinct MI300X", "gfx942:sramecc+:xnack-", 9, 4)])
    gpus = rocm.probe().details["gpus"]
    assert not gpus[0].fp8 and gpus[1].fp8
    with pytest.raises(BackendUnavailable, match="MI300 \\(gfx942\\)"):
        rocm.create(rocm.probe(), precision="fp8")


def test_fp8_conversion_skips_the_output_head(monkeypatch, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    picked = []

    def convert_to_float8_training(model, module_filter_fn):
        picked.extend(name for name, mod in model.named_modules() if module_filter_fn(mod, name))

    fake = types.ModuleType("torchao.float8")
    fake.convert_to_float8_training = convert_to_float8_training
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", fake)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    fp8_training.convert_to_fp8(model)
    assert picked and "lm_head" not in picked
    assert all(isinstance(model.get_submodule(n), torch.nn.Linear) for n in picked)


@pytest.mark.parametrize("adapter, memory, held", [
    ("qlora", None, "adapter.type: qlora keeps them as 4-bit codes"),
    ("lora", {"stream_layers": True}, "memory.stream_layers keeps them in host memory"),
])
def test_fp8_with_frozen_base_layers_is_refused_before_the_weights_load(monkeypatch, tiny_model_dir, adapter, memory,
                                                                        held):
    from mudpuppy.backends.torch import backend as torch_backend
    from mudpuppy.config import AdapterConfig, MemoryConfig, ModelConfig

    monkeypatch.setattr(torch_backend, "load_model_weights", lambda *a, **k: pytest.fail("weights loaded"))
    plan = DevicePlan("cuda", torch.device("cpu"), torch.bfloat16, fp8=True, precision="fp8",
                      memory=MemoryConfig(**memory) if memory else None)
    with pytest.raises(MudpuppyError, match=f"training.precision: fp8 .*but {held}; use precision bf16"):
        TorchBackend(plan).load_model(ModelConfig(base_model=str(tiny_model_dir)), adapter=AdapterConfig(type=adapter))


def test_fp8_conversion_leaves_frozen_layers_alone(monkeypatch, tiny_model_dir):
    """A frozen layer subclasses nn.Linear; torchao would swap it and assign its read-only weight."""
    from mudpuppy.backends.torch.model.frozen import StoredLinear
    from transformers import AutoModelForCausalLM

    picked = []
    fake = types.ModuleType("torchao.float8")
    fake.convert_to_float8_training = lambda model, module_filter_fn: picked.extend(
        name for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear) and module_filter_fn(mod, name))
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", fake)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    attention = model.model.layers[0].self_attn
    plain = attention.q_proj
    attention.q_proj = StoredLinear.from_weight(plain.weight.detach(), plain.bias, torch.device("cpu"), None)
    fp8_training.convert_to_fp8(model)
    assert "model.layers.0.self_attn.q_proj" not in picked and "model.layers.0.self_attn.k_proj" in picked


# ------------------------------------------------------------ load path, steps

def test_rocm_plan_reads_weights_straight_onto_the_planned_gpu(monkeypatch, tiny_model_dir):
    """Tensor by tensor onto the GPU the plan picked (never device_map="auto": it crashes with an
    iGPU present), at the dtype the GPU computes in for a frozen base."""
    from mudpuppy.backends.torch.model import loading
    from mudpuppy.config import AdapterConfig, ModelConfig
    from transformers import AutoModelForCausalLM

    Machine(monkeypatch, "rocm", [RAPHAEL_IGPU, RX_7900_XTX])
    backend = rocm.create(rocm.probe())
    seen = {}
    real = loading.load_weights

    def load_weights(model, directory, dtype, device, frozen, new_modules):
        seen.update(device=device, dtype=dtype)
        return real(model, directory, dtype, torch.device("cpu"), frozen, new_modules)   # no real GPU here

    def from_pretrained(*args, **kwargs):
        raise AssertionError(f"from_pretrained called ({kwargs}): a safetensors checkpoint is read tensor by tensor")

    monkeypatch.setattr(loading, "load_weights", load_weights)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    handle = backend.load_model(ModelConfig(base_model=str(tiny_model_dir)), adapter=AdapterConfig(type="lora"))
    assert seen == {"device": torch.device("cuda", 1), "dtype": torch.bfloat16}
    assert handle.autocast_dtype is torch.bfloat16
    assert handle.load_report.path == "streamed"
    assert {p.dtype for p in handle.model.parameters()} == {torch.bfloat16}


def _trainer(tiny_config, plan: DevicePlan):
    from mudpuppy import load_config
    from mudpuppy.data import Batcher, prepare_sft_data

    cfg = load_config(tiny_config)
    backend = TorchBackend(plan)
    backend.seed(0)
    handle = backend.load_model(cfg.model, "auto")
    backend.attach_adapter(handle, cfg.adapter)
    trainer = backend.create_trainer(handle, cfg.training)
    data = prepare_sft_data(cfg, handle.tokenizer)
    batcher = Batcher(data.train, 4, handle.tokenizer.pad_token_id, 0, False)
    return trainer, batcher


def test_fp16_plan_steps_with_a_grad_scaler(tiny_config):
    """The loss-scaling path runs for real: CPU autocast supports fp16 too."""
    plan = DevicePlan("cpu", torch.device("cpu"), torch.float16, loss_scaling=True)
    trainer, batcher = _trainer(tiny_config, plan)
    assert isinstance(trainer.scaler, torch.amp.GradScaler)
    before = [p.detach().clone() for p in trainer.params]
    result = trainer.step([batcher.next_batch()], 1e-2)
    assert not result.skipped and torch.isfinite(torch.tensor(result.loss))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.params))
    assert "loss_scaler" in trainer.state_dict()


def test_fp16_overflow_skips_the_step_and_lowers_the_scale(tiny_config):
    plan = DevicePlan("cpu", torch.device("cpu"), torch.float16, loss_scaling=True)
    trainer, batcher = _trainer(tiny_config, plan)
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)  # overflows fp16 at once
    before = [p.detach().clone() for p in trainer.params]
    result = trainer.step([batcher.next_batch()], 1e-2)
    assert result.skipped
    assert trainer.scaler.get_scale() < 2.0**100
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.params))


def test_bf16_and_fp32_plans_use_no_grad_scaler(tiny_config):
    for dtype in (torch.bfloat16, None):
        plan = DevicePlan("cpu", torch.device("cpu"), dtype, loss_scaling=True)
        trainer, _ = _trainer(tiny_config, plan)
        assert trainer.scaler is None and "loss_scaler" not in trainer.state_dict()


# ------------------------------------------------------------------- reporting

def test_attention_report_names_the_kernel_torch_would_run():
    """Not simulated: on this CPU, torch's own chooser answers."""
    report = devices.attention_report("cpu", torch.bfloat16)
    kinds = {"flash", "memory-efficient", "cudnn", "math"}
    assert report["causal"] in kinds and report["masked"] in kinds
    assert report["dtype"] == "bfloat16" and set(report["enabled"]) == {"flash", "memory-efficient", "math", "cudnn"}
    text = devices.describe_attention(report)
    assert text.startswith(f"sdpa: {report['causal']} kernel for causal batches")


def test_cli_backends_lists_every_gpu_with_its_verdict(monkeypatch):
    from mudpuppy.cli import main

    Machine(monkeypatch, "rocm", [RX_7900_XTX, RAPHAEL_IGPU])
    out = CliRunner().invoke(main, ["backends"]).output
    rocm_line = next(line for line in out.splitlines() if line.startswith("rocm"))
    assert "available  cuda:0 (AMD Radeon RX 7900 XTX, gfx1100, 24 GiB, bf16) with HIP" in rocm_line
    assert "cuda:1 (AMD Radeon Graphics, gfx1036, 2 GiB, fp16) skipped: integrated GPU" in out
    assert "allocator: PYTORCH_HIP_ALLOC_CONF=max_split_size_mb:128" in out
    assert any(line.startswith("cuda") and "is the ROCm build" in line for line in out.splitlines())
    assert factory.probe("rocm").available
