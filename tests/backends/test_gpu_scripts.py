"""The GPU benchmark scripts, checked on the CPU as far as a CPU allows: what they would train is a valid
config on mudpuppy's real paths, and without a GPU they say so and exit 2."""

from __future__ import annotations

import importlib.util
import sys
from argparse import Namespace

from mudpuppy import load_config

from ..conftest import REPO


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_gpu_smoke_trains_qlora_through_the_adapter_config_and_checkpoints_like_trl(tmp_path):
    smoke = load_script("gpu_smoke")
    args = Namespace(steps=8, batch=8, seq_len=256)
    for qlora, adapter in ((False, "lora"), (True, "qlora")):
        cfg = load_config(smoke.mudpuppy_config(args, "cpu", tmp_path / adapter, qlora), check_files=False)
        assert cfg.adapter.type == adapter and cfg.training.gradient_checkpointing is True
    assert cfg.adapter.quant_backend == "int4"


def test_gpu_smoke_without_a_gpu_says_so_and_exits_2(capsys):
    smoke = load_script("gpu_smoke")
    assert smoke.main(["--steps", "3", "--warmup", "1", "--qlora"]) == smoke.NO_GPU_EXIT
    assert "no CUDA or ROCm GPU here" in capsys.readouterr().err


def test_memory_scale_takes_bf16_from_mudpuppys_plan_not_torchs_flag(monkeypatch):
    """ROCm answers torch.cuda.is_bf16_supported() True on every card, emulated bf16 included; the benchmark asks
    mudpuppy's plan (the GPU's architecture) so both sides train at the precision mudpuppy would pick."""
    import types

    import mudpuppy
    import torch
    from mudpuppy.backends.torch.devices import gpu as devices

    scale = load_script("memory_scale")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(devices, "torch_build", lambda: "rocm")
    asked = []
    for precision in ("fp16", "bf16"):
        def fake_backend(name, precision=precision):
            asked.append(name)
            return types.SimpleNamespace(plan=types.SimpleNamespace(precision=precision))

        monkeypatch.setattr(mudpuppy, "create_backend", fake_backend)
        assert scale.native_bf16(gpu=True) is (precision == "bf16")
    assert asked == ["rocm", "rocm"]
