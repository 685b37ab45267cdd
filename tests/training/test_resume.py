"""Checkpoints and exact resume: SIGKILL mid-run, Ctrl-C, non-finite losses, mismatched resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from mudpuppy import create_backend, load_config, run
from mudpuppy.distributed import Ranks
from mudpuppy.errors import MudpuppyError, OutputExists
from mudpuppy.training import checkpoints
from mudpuppy.training.loop import Interrupted, TrainingDiverged

from ..faults import kill_after

K = 4


def resume_config(tiny_config, out):
    cfg = dict(tiny_config, output_dir=str(out))
    # Dropout on: exact resume must restore the RNG that draws the dropout masks.
    cfg["adapter"] = {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.1}
    cfg["training"] = dict(tiny_config["training"], max_steps=2 * K, save_steps=K, micro_batch_size=4,
                           lr_scheduler="cosine", warmup_steps=2)
    cfg["eval"] = {"before_training": False, "after_training": False}
    return cfg


def cli(cfg_path, *extra, env=None):
    return subprocess.run([sys.executable, "-m", "mudpuppy.cli", "run", "-c", str(cfg_path), *extra],
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300)


def metrics(out):
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def test_sigkill_then_resume_matches_an_uninterrupted_run(tiny_config, tmp_path):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    for out in (straight, broken):
        (tmp_path / f"{out.name}.yaml").write_text(yaml.safe_dump(resume_config(tiny_config, out)))

    assert cli(tmp_path / "straight.yaml").returncode == 0
    killed = cli(tmp_path / "broken.yaml", env=kill_after(K))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [c.name for c in checkpoints.list_checkpoints(broken)] == [f"step-{K:08d}"]
    assert not (broken / "run_summary.json").exists()

    # Without --resume the half-finished run is protected, not overwritten.
    refused = cli(tmp_path / "broken.yaml")
    assert refused.returncode == 2 and "--resume" in refused.stderr

    resumed = cli(tmp_path / "broken.yaml", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from" in resumed.stdout
    assert "Failed to load" not in resumed.stderr              # torchao's import lines, dropped (noise.py)

    a, b = metrics(straight), metrics(broken)
    assert [r["step"] for r in b] == list(range(1, 2 * K + 1))
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], atol=1e-5, rtol=0)
    assert [r["lr"] for r in b] == [r["lr"] for r in a]
    wa = load_file(str(straight / "adapter_model.safetensors"))
    wb = load_file(str(broken / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys()
    for key in wa:
        np.testing.assert_array_equal(wa[key], wb[key])
    summary = json.loads((broken / "run_summary.json").read_text())
    assert summary["resumed_from_step"] == K


def test_resume_refuses_a_checkpoint_from_another_adapter(tiny_config, tmp_path):
    cfg = resume_config(tiny_config, tmp_path / "run")
    with pytest.raises(Interrupted):
        run(load_config(cfg), _InterruptingBackend(create_backend("cpu"), at_call=K + 2), echo=lambda *_: None)
    cfg["adapter"]["r"] = 8
    cfg["resume"] = True
    for allow_changes in (False, True):         # the weights' shape: no flag changes it
        with pytest.raises(MudpuppyError, match="adapter.r: 4 -> 8\nno flag changes these"):
            run(load_config(cfg), create_backend("cpu"), echo=lambda *_: None, allow_changes=allow_changes)


def test_resume_without_a_checkpoint_is_a_clear_error(tiny_config, tmp_path):
    cfg = resume_config(tiny_config, tmp_path / "empty")
    cfg["resume"] = True
    with pytest.raises(OutputExists, match="no complete checkpoint"):
        run(load_config(cfg), create_backend("cpu"), echo=lambda *_: None)
    cfg["resume"] = "auto"           # auto starts fresh when there is nothing to resume
    assert run(load_config(cfg), create_backend("cpu"), echo=lambda *_: None).steps == 2 * K


class _InterruptingBackend:
    """The cpu backend, with Ctrl-C (a real SIGINT) arriving during the n-th optimizer step;
    `presses=2` presses it twice, which means "stop at once"."""

    def __init__(self, inner, at_call, presses=1, sig=signal.SIGINT):
        self.inner, self.at_call, self.presses, self.calls, self.sig = inner, at_call, presses, 0, sig

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def create_trainer(self, handle, cfg):
        trainer = self.inner.create_trainer(handle, cfg)
        step = trainer.step

        def interrupting(micro, lr):
            self.calls += 1
            if self.calls == self.at_call:
                for _ in range(self.presses):
                    os.kill(os.getpid(), self.sig)
            return step(micro, lr)

        trainer.step = interrupting
        return trainer


def test_ctrl_c_finishes_the_step_saves_and_resumes_exactly(tiny_config, tmp_path):
    """Ctrl-C mid-step: the step completes, a checkpoint is written, and the resumed run
    equals an uninterrupted one (dropout on, so the RNG must be exactly where it was)."""
    straight = run(load_config(resume_config(tiny_config, tmp_path / "straight")), create_backend("cpu"),
                   echo=lambda *_: None)
    cfg = resume_config(tiny_config, tmp_path / "run")
    cfg["training"]["save_steps"] = 100
    with pytest.raises(Interrupted) as info:
        run(load_config(cfg), _InterruptingBackend(create_backend("cpu"), at_call=3), echo=lambda *_: None)
    assert info.value.exit_code == 130 and "--resume" in str(info.value)
    assert [c.name for c in checkpoints.list_checkpoints(tmp_path / "run")] == ["step-00000003"]
    cfg["resume"] = True
    resumed = run(load_config(cfg), create_backend("cpu"), echo=lambda *_: None)
    assert resumed.steps == 2 * K and resumed.resumed_from == 3
    np.testing.assert_allclose(resumed.losses, straight.losses, atol=1e-6, rtol=0)


def test_ctrl_c_during_the_last_step_stops_too_and_resume_finishes_the_run(tiny_config, tmp_path):
    """Ctrl-C during the last step means stop as it does during any other: the run ends with its checkpoint
    and exit code 130 instead of going on to the evaluation and merge after training (minutes on a big
    model, and a second Ctrl-C there used to leave weights without run_summary.json); --resume then runs
    no step and finishes: the weights, the evaluation, the summary, equal to an uninterrupted run's."""
    straight = run(load_config(resume_config(tiny_config, tmp_path / "straight")), create_backend("cpu"),
                   echo=lambda *_: None)
    cfg = resume_config(tiny_config, tmp_path / "run")
    cfg["eval"] = {"before_training": False, "after_training": True}
    with pytest.raises(Interrupted, match=f"after step {2 * K} of {2 * K}") as info:
        run(load_config(cfg), _InterruptingBackend(create_backend("cpu"), at_call=2 * K), echo=lambda *_: None)
    assert info.value.exit_code == 130 and "--resume" in str(info.value)
    out = tmp_path / "run"
    assert [c.name for c in checkpoints.list_checkpoints(out)] == [f"step-{K:08d}", f"step-{2 * K:08d}"]
    assert not (out / "run_summary.json").exists()
    cfg["resume"] = True
    resumed = run(load_config(cfg), create_backend("cpu"), echo=lambda *_: None)
    assert resumed.steps == 2 * K and resumed.resumed_from == 2 * K and resumed.after is not None
    np.testing.assert_allclose(resumed.losses, straight.losses, atol=1e-6, rtol=0)
    assert (out / "run_summary.json").exists()
    mine, theirs = load_file(out / "adapter_model.safetensors"), load_file(tmp_path / "straight" / "adapter_model.safetensors")
    assert mine.keys() == theirs.keys()
    for name in mine:
        np.testing.assert_allclose(mine[name], theirs[name], atol=1e-6, rtol=0)


def test_sigterm_from_a_scheduler_finishes_the_step_and_saves_like_ctrl_c(tiny_config, tmp_path):
    """SLURM, Kubernetes and preempted cloud machines stop a job with SIGTERM (then SIGKILL): the step in
    progress completes and its checkpoint is written; the exit code is the shell's for SIGTERM."""
    cfg = resume_config(tiny_config, tmp_path / "run")
    cfg["training"]["save_steps"] = 100
    with pytest.raises(Interrupted, match="terminated after step 3 of 8; checkpoint saved to") as info:
        run(load_config(cfg), _InterruptingBackend(create_backend("cpu"), at_call=3, sig=signal.SIGTERM),
            echo=lambda *_: None)
    assert info.value.exit_code == 143
    assert [c.name for c in checkpoints.list_checkpoints(tmp_path / "run")] == ["step-00000003"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL          # the handler is gone with the loop


def test_one_rank_of_several_leaves_sigterm_to_the_launcher():
    """torchrun sends SIGTERM to the other ranks when one failed: finishing the step would wait on the dead
    rank's collectives, so a distributed rank only takes Ctrl-C over."""
    from mudpuppy.training.loop import GracefulStop

    with GracefulStop(print, distributed=True):
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    with GracefulStop(print, distributed=False):
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL


def test_second_ctrl_c_stops_at_once_and_saves_nothing_half_done(tiny_config, tmp_path):
    cfg = resume_config(tiny_config, tmp_path / "run")
    cfg["training"]["save_steps"] = 2
    with pytest.raises(Interrupted, match="stopped at once during step 3; nothing was saved") as info:
        run(load_config(cfg), _InterruptingBackend(create_backend("cpu"), at_call=3, presses=2), echo=lambda *_: None)
    assert "step-00000002" in str(info.value)
    assert [c.name for c in checkpoints.list_checkpoints(tmp_path / "run")] == ["step-00000002"]


class _NaNOnce:
    """Make the loss of the n-th micro-batch non-finite, as a bad batch or overflow would."""

    def __init__(self, backend, at_call):
        self.backend, self.at_call, self.calls = backend, at_call, 0
        self.original = backend.loss_sum

    def __call__(self, handle, batch):
        self.calls += 1
        loss, n = self.original(handle, batch)
        return (loss * float("nan"), n) if self.calls == self.at_call else (loss, n)


def test_on_nan_skip_leaves_weights_and_optimizer_untouched(tiny_config, tmp_path, monkeypatch):
    import torch

    backend = create_backend("cpu")
    cfg = resume_config(tiny_config, tmp_path / "run")
    cfg["training"].update(on_nan="skip", save_steps=None, max_steps=3)
    snapshots = []
    original_step = backend.create_trainer

    def create_trainer(handle, tcfg):
        trainer = original_step(handle, tcfg)
        step = trainer.step

        def recording(micro, lr):
            res = step(micro, lr)
            params = {n: p.detach().clone() for n, p in handle.model.named_parameters() if p.requires_grad}
            adam_steps = [float(s["step"]) for s in trainer.optimizer.state.values()]
            snapshots.append((res.skipped, params, adam_steps))
            return res

        trainer.step = recording
        return trainer

    monkeypatch.setattr(backend, "create_trainer", create_trainer)
    monkeypatch.setattr(backend, "loss_sum", _NaNOnce(backend, at_call=2))
    result = run(load_config(cfg), backend, echo=lambda *_: None)
    assert [s[0] for s in snapshots] == [False, True, False]
    assert result.skipped_steps == 1
    (_, p1, a1), (_, p2, a2) = snapshots[0], snapshots[1]
    assert all(torch.equal(p1[n], p2[n]) for n in p1)
    assert a1 == a2 == [1.0] * len(a1)
    assert json.loads((tmp_path / "run" / "run_summary.json").read_text())["skipped_steps"] == 1


def test_on_nan_stop_keeps_the_last_good_checkpoint(tiny_config, tmp_path, monkeypatch):
    backend = create_backend("cpu")
    cfg = resume_config(tiny_config, tmp_path / "run")
    cfg["training"].update(on_nan="stop", save_steps=2)
    monkeypatch.setattr(backend, "loss_sum", _NaNOnce(backend, at_call=3))
    with pytest.raises(TrainingDiverged) as info:
        run(load_config(cfg), backend, echo=lambda *_: None)
    assert info.value.exit_code == 3
    assert "step 3: non-finite" in str(info.value) and "step-00000002" in str(info.value)
    assert [c.name for c in checkpoints.list_checkpoints(tmp_path / "run")] == ["step-00000002"]
    assert not (tmp_path / "run" / "run_summary.json").exists()


def test_half_written_checkpoints_are_invisible_and_old_ones_pruned(tmp_path):
    calls = []
    for step in (1, 2, 3):
        checkpoints.save_checkpoint(tmp_path, step, {"m": 1}, {"step": step}, lambda d: calls.append(d), keep_last_n=2,
                                    ranks=Ranks())
    assert [c.name for c in checkpoints.list_checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    # A crash mid-save leaves a staging directory (or a directory without the marker): never "complete".
    (tmp_path / "checkpoints" / ".tmp-step-00000004-99").mkdir()
    (tmp_path / "checkpoints" / "step-00000005").mkdir()
    assert checkpoints.newest_checkpoint(tmp_path).name == "step-00000003"
    checkpoints.remove_stale_staging(tmp_path)
    assert not (tmp_path / "checkpoints" / ".tmp-step-00000004-99").exists()


def test_early_stopping_ends_the_run_after_patience_runs_out(tiny_config, tmp_path):
    cfg = resume_config(tiny_config, tmp_path / "run")
    cfg["training"].update(eval_steps=1, early_stopping_patience=2, early_stopping_min_delta=100.0,
                           save_steps=None, max_steps=10)
    result = run(load_config(cfg), create_backend("cpu"), echo=lambda *_: None)
    assert result.stopped_early and result.steps == 3
    evals = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("eval_loss" in r for r in evals) == 3
    assert checkpoints.newest_checkpoint(tmp_path / "run").name == "step-00000003"


def test_a_checkpoint_written_on_a_gpu_resumes_on_the_cpu_exactly(tiny_config, tmp_path):
    """trainer.pt of a cuda or rocm run also holds the CUDA generator's state, which a machine without a GPU
    has no generator to take: the rest resumes (the CPU generator that draws dropout here included)."""
    import torch

    straight = run(load_config(resume_config(tiny_config, tmp_path / "straight")), create_backend("cpu"),
                   echo=lambda *_: None)
    cfg = resume_config(tiny_config, tmp_path / "run")
    with pytest.raises(Interrupted):
        run(load_config(cfg), _InterruptingBackend(create_backend("cpu"), at_call=K + 1, presses=2),
            echo=lambda *_: None)
    ckpt = checkpoints.newest_checkpoint(tmp_path / "run")
    state = torch.load(ckpt / "trainer.pt", weights_only=True)
    torch.save({**state, "cuda_rng": torch.zeros(16, dtype=torch.uint8)}, ckpt / "trainer.pt")
    marker = json.loads((ckpt / checkpoints.MARKER).read_text())
    marker["files"]["trainer.pt"] = (ckpt / "trainer.pt").stat().st_size
    marker[checkpoints.DIGESTS]["trainer.pt"] = checkpoints.file_digest(ckpt / "trainer.pt")   # as a GPU wrote it
    (ckpt / checkpoints.MARKER).write_text(json.dumps(marker))
    cfg["resume"] = True
    resumed = run(load_config(cfg), create_backend("cpu"), echo=lambda *_: None)
    assert resumed.resumed_from == K and resumed.losses == straight.losses
    written = json.loads((ckpt.parent / f"step-{2 * K:08d}" / "portable_state.json").read_text())["written_by"]
    assert written == {"runtime": "torch", "backend": "cpu"}
