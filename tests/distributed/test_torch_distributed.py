"""torch.distributed on the CPU (gloo, 2 processes, tiny model, fp32): DDP and FSDP2 against one process.

Every distributed run here is the real thing: `mudpuppy run --nproc 2` starts two
processes through torch.distributed.run, they join a gloo process group and
train through DistributedDataParallel or FSDP2's fully_shard. The oracle is the
same run in one process at the same global batch (torchtune and
LLaMA-Factory's check: per-step losses equal at 1e-5).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from mudpuppy import create_backend, load_config, run
from mudpuppy.training import checkpoints

from ..conftest import QUICKSTART_DATA
from ..faults import kill_after

STEPS = 6
TOL = 1e-5


def quiet(*_):
    pass


def sft_config(base, out: Path, micro: int, accumulation: int = 1, **training) -> dict:
    cfg = dict(base, output_dir=str(out))
    cfg["adapter"] = {"type": "lora", "r": 4, "alpha": 8}          # no dropout: ranks draw different masks
    cfg["training"] = dict(base["training"], max_steps=STEPS, micro_batch_size=micro,
                           gradient_accumulation_steps=accumulation, **training)
    cfg["eval"] = {"before_training": False, "after_training": False}
    return cfg


def launch(cfg: dict, path: Path, *extra, nproc: int | None = 2, env: dict | None = None):
    path.write_text(yaml.safe_dump(cfg))
    command = [sys.executable, "-m", "mudpuppy", "run", "-c", str(path), *extra]
    if nproc:
        command += ["--nproc", str(nproc)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def one_process(cfg: dict):
    return run(load_config(cfg), create_backend("cpu"), echo=quiet)


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def assert_same_adapter(a: Path, b: Path, atol: float = TOL) -> None:
    wa, wb = load_file(str(a / "adapter_model.safetensors")), load_file(str(b / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and wa
    for key in wa:
        np.testing.assert_allclose(wb[key], wa[key], atol=atol, rtol=0, err_msg=key)
    ca, cb = (json.loads((d / "adapter_config.json").read_text()) for d in (a, b))
    # PEFT writes target_modules from a set: its order follows the process's string hashing.
    assert set(ca.pop("target_modules")) == set(cb.pop("target_modules"))
    assert ca == cb


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """One process, micro batch 4: the run every distributed one must equal."""
    tmp = tmp_path_factory.mktemp("reference")
    cfg = sft_config(_tiny(tiny_model_dir, tmp), tmp / "one", micro=4)
    one_process(cfg)
    return tmp / "one"


def _tiny(tiny_model_dir, tmp) -> dict:
    return {
        "model": {"base_model": str(tiny_model_dir)},
        "backend": "cpu",
        "method": "sft",
        "adapter": {"type": "lora", "r": 4, "alpha": 8, "target_modules": "all-linear"},
        "data": {"datasets": [{"path": str(QUICKSTART_DATA / "smart_home_train.jsonl"), "num_samples": 64}],
                 "val_datasets": [{"path": str(QUICKSTART_DATA / "smart_home_val.jsonl"), "num_samples": 16}],
                 "sequence_len": 128},
        "training": {"max_steps": STEPS, "micro_batch_size": 4, "learning_rate": 5e-3, "precision": "fp32",
                     "warmup_steps": 1, "seed": 3},
        "output_dir": str(tmp / "run"),
        "logging": {"progress_bar": False},
    }


@pytest.mark.parametrize("strategy,micro,accumulation", [("ddp", 2, 1), ("ddp", 1, 2), ("fsdp", 2, 1)])
def test_two_processes_equal_one_at_the_same_global_batch(strategy, micro, accumulation, reference, tiny_model_dir,
                                                          tmp_path):
    cfg = sft_config(_tiny(tiny_model_dir, tmp_path), tmp_path / "two", micro, accumulation)
    cfg["distributed"] = {"strategy": strategy}
    done = launch(cfg, tmp_path / "two.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "launching 2 processes" in done.stdout
    assert done.stdout.count("saved to") == 1, "rank 0 alone reports the run"
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(reference), atol=TOL, rtol=0)
    assert len(losses(tmp_path / "two")) == STEPS
    assert_same_adapter(reference, tmp_path / "two")
    summary = json.loads((tmp_path / "two" / "run_summary.json").read_text())
    assert summary["steps"] == STEPS


def test_a_rank_killed_mid_run_resumes_to_the_uninterrupted_losses(reference, tiny_model_dir, tmp_path):
    out = tmp_path / "broken"
    cfg = sft_config(_tiny(tiny_model_dir, tmp_path), out, micro=2, save_steps=3)
    killed = launch(cfg, tmp_path / "broken.yaml", env=kill_after(3, rank=1))
    assert killed.returncode != 0
    message = killed.stderr.strip().splitlines()[-1]
    assert message.startswith("error: rank 1 failed: killed by SIGKILL; every process was stopped"), killed.stderr
    assert "step-00000003" in message and "--resume" in message
    assert [c.name for c in checkpoints.list_checkpoints(out)] == ["step-00000003"]
    assert (out / "checkpoints" / "step-00000003" / "sharded" / ".metadata").is_file()
    assert (out / "checkpoints" / "step-00000003" / "adapter_model.safetensors").is_file()

    resumed = launch(cfg, tmp_path / "broken.yaml", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    np.testing.assert_allclose(losses(out), losses(reference), atol=TOL, rtol=0)
    assert_same_adapter(reference, out)


def test_an_fsdp_checkpoint_of_two_processes_resumes_in_one(reference, tiny_model_dir, tmp_path):
    out = tmp_path / "sharded"
    cfg = sft_config(_tiny(tiny_model_dir, tmp_path), out, micro=2, save_steps=3)
    cfg["distributed"] = {"strategy": "fsdp"}
    killed = launch(cfg, tmp_path / "sharded.yaml", env=kill_after(3))
    assert killed.returncode != 0
    assert [c.name for c in checkpoints.list_checkpoints(out)] == ["step-00000003"]

    # One process, micro batch 4: the same global batch, so the same remaining steps.
    cfg["training"]["micro_batch_size"] = 4
    cfg["resume"] = True
    result = one_process(cfg)
    assert result.resumed_from == 3
    np.testing.assert_allclose(losses(out), losses(reference), atol=TOL, rtol=0)
    assert_same_adapter(reference, out)


def test_dpo_under_ddp_equals_dpo_in_one_process(tiny_model_dir, tmp_path):
    from ..training.test_preference_runs import preference_config

    def dpo(out, micro):
        cfg = preference_config(tiny_model_dir, tmp_path, "dpo")
        cfg["output_dir"] = str(out)
        # SGD: the gradients themselves are compared through the weights. Under AdamW the update of a
        # coordinate whose gradients nearly cancel across steps is m/sqrt(v) of a near-zero m, which turns
        # the float rounding of a different summation order (2 x 2 rows all-reduced vs 4 rows) into a
        # visible change: 4.3e-5 on one of 128 weights, measured on an AVX-512 CPU, where AVX2 gave < 1e-5.
        cfg["training"].update(max_steps=3, micro_batch_size=micro, optimizer="sgd", learning_rate=0.5)
        cfg["eval"] = {"before_training": False, "after_training": False}
        return cfg

    one_process(dpo(tmp_path / "one", 4))
    done = launch(dpo(tmp_path / "two", 2), tmp_path / "two.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), atol=TOL, rtol=0)
    assert_same_adapter(tmp_path / "one", tmp_path / "two")
    trained = load_file(str(tmp_path / "one" / "adapter_model.safetensors"))
    assert max(float(np.abs(w).max()) for k, w in trained.items() if "lora_B" in k) > 1e-3   # it did train
    assert losses(tmp_path / "one")[-1] < losses(tmp_path / "one")[0]


def test_a_user_error_stops_every_rank_with_one_message(tiny_model_dir, tmp_path):
    cfg = sft_config(_tiny(tiny_model_dir, tmp_path), tmp_path / "qlora", micro=2)
    cfg["adapter"] = {"type": "qlora", "r": 4, "alpha": 8}
    cfg["distributed"] = {"strategy": "fsdp"}
    done = launch(cfg, tmp_path / "qlora.yaml")
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, done.stderr
    # Every rank refuses it; the launcher names the first that exited.
    assert errors[0].startswith("error: rank ") and \
        "failed: distributed.strategy: fsdp shards parameters, and QLoRA" in errors[0]


def test_nproc_refuses_fsdp_on_mlx(tiny_model_dir, tmp_path):
    cfg = sft_config(_tiny(tiny_model_dir, tmp_path), tmp_path / "mlx", micro=2)
    cfg["backend"] = "mlx"
    cfg["distributed"] = {"strategy": "fsdp"}
    done = launch(cfg, tmp_path / "mlx.yaml")
    assert done.returncode == 2
    assert "fsdp is torch's (FSDP2); MLX trains data-parallel only" in done.stderr
    assert not (tmp_path / "mlx").exists()


@pytest.mark.parametrize("strategy,adapter", [("ddp", "qlora"), ("fsdp", "dora"), ("fsdp", "none")])
def test_other_adapters_equal_one_process(strategy, adapter, tiny_model_dir, tmp_path):
    def config(out, micro):
        cfg = sft_config(_tiny(tiny_model_dir, tmp_path), out, micro)
        cfg["training"]["max_steps"] = 3
        cfg["adapter"] = {"type": adapter, **({"r": 4, "alpha": 8} if adapter != "none" else {})}
        if adapter == "qlora":
            cfg["adapter"]["quant_group_size"] = 32         # the tiny model's widths
        if adapter == "none":
            cfg["training"]["learning_rate"] = 1e-4
        cfg["distributed"] = {"strategy": strategy}
        return cfg

    one_process(config(tmp_path / "one", 4))
    done = launch(config(tmp_path / "two", 2), tmp_path / "two.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), atol=TOL, rtol=0)
    if adapter == "none":
        wa = load_file(str(tmp_path / "one" / "model.safetensors"))
        wb = load_file(str(tmp_path / "two" / "model.safetensors"))
        assert wa.keys() == wb.keys()
        for key in wa:
            np.testing.assert_allclose(wb[key], wa[key], atol=TOL, rtol=0, err_msg=key)
    else:
        assert_same_adapter(tmp_path / "one", tmp_path / "two")
