"""The training loop reports through callbacks: a callback passed to it hears every step, every held-out check,
every checkpoint and the end, with the numbers the trainer returned; metrics.jsonl is one such callback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mudpuppy import load_config
from mudpuppy.backends.protocol import StepResult
from mudpuppy.distributed import Ranks
from mudpuppy.errors import OutOfDeviceMemory
from mudpuppy.monitor.callbacks import Callback
from mudpuppy.training import results
from mudpuppy.training.loop import Checkpoints, LoopState, train_loop

# The losses the trainer below returns, step by step: the oracle every callback's numbers are checked against.
LOSSES = [2.5, 2.25, 1.875, 1.5, 1.125, 0.8125]
EVALS = [3.0, 2.0, 2.5]          # held-out loss at steps 2, 4, 6


class Trainer:
    """A trainer whose steps return known numbers (step i: LOSSES[i], 10 * (i + 1) tokens)."""

    def __init__(self, fail_at: int | None = None):
        self.calls, self.fail_at = 0, fail_at

    def step(self, micro_batches, lr, objective=None):
        i = self.calls
        self.calls += 1
        if i == self.fail_at:
            raise OutOfDeviceMemory("out of memory.")
        return StepResult(loss=LOSSES[i], loss_tokens=5, tokens=10 * (i + 1), grad_norm=0.5 + i,
                          metrics={"kl": i / 8})


class Batches:
    epoch = 0

    def next_batch(self):
        return {}

    def state_dict(self):
        return {}


class Rollouts(Batches):
    """A batcher that samples its batches, as GRPO's does: numbers and completions for every second step."""

    def __init__(self):
        self.made = 0

    def next_batch(self):
        self.made += 1
        return {}

    def pop_metrics(self):
        return {"reward": self.made / 4} if self.made % 2 else {}

    def pop_samples(self):
        return [{"prompt": "p", "completion": f"c{self.made}", "reward": 1.0}] if self.made % 2 else []


class Spy(Callback):
    def __init__(self):
        self.calls = []

    def on_run_start(self, total, done):
        self.calls.append(("start", total, done))

    def on_samples(self, step, samples):
        self.calls.append(("samples", step, samples))

    def on_log(self, record):
        self.calls.append(("log", record))

    def on_step_end(self, step, metrics):
        self.calls.append(("step", step, metrics))

    def on_eval_end(self, step, metrics):
        self.calls.append(("eval", step, metrics))

    def on_checkpoint(self, step, path):
        self.calls.append(("checkpoint", step, path))

    def on_run_end(self):
        self.calls.append(("end",))

    def of(self, kind):
        return [c[1:] for c in self.calls if c[0] == kind]


def config(tiny_config, log_every: int = 1, **training):
    tiny_config["training"].update(max_steps=6, warmup_steps=0, lr_scheduler="constant", **training)
    tiny_config["logging"] = {"progress_bar": False, "log_every": log_every}
    return load_config(tiny_config)


def evaluator():
    values = iter(EVALS)

    def evaluate():
        value = next(values)
        return value, {"eval_loss": value}

    return evaluate


def saver(out: Path, saved: list) -> Checkpoints:
    def save(state: LoopState) -> Path:
        saved.append(state.step)
        return out / f"checkpoint-{state.step}"

    return Checkpoints(out, save)


def test_a_callback_hears_every_step_eval_checkpoint_and_the_end(tiny_config, tmp_path):
    cfg = config(tiny_config, eval_steps=2, save_steps=3)
    out, saved, spy = tmp_path / "out", [], Spy()
    out.mkdir()
    stopped = train_loop(cfg, LoopState(), 6, Trainer(), Batches(), saver(out, saved), [spy], evaluate=evaluator())
    assert stopped is False
    assert spy.calls[0] == ("start", 6, 0) and spy.calls[-1] == ("end",)
    steps = spy.of("step")
    assert [s for s, _ in steps] == [1, 2, 3, 4, 5, 6]
    assert [m["loss"] for _, m in steps] == LOSSES                      # unrounded, as the trainer returned them
    assert [m["tokens_per_second"] > 0 for _, m in steps] == [True] * 6
    assert [(m["tokens"], m["grad_norm"], m["kl"], m["lr"]) for _, m in steps] == [
        (10 * (i + 1), 0.5 + i, i / 8, cfg.training.learning_rate) for i in range(6)]
    assert spy.of("eval") == [(2, {"eval_loss": 3.0}), (4, {"eval_loss": 2.0}), (6, {"eval_loss": 2.5})]
    assert spy.of("checkpoint") == [(3, out / "checkpoint-3"), (6, out / "checkpoint-6")] and saved == [3, 6]
    assert [c[0] for c in spy.calls[1:5]] == ["log", "step", "log", "step"]     # a step's line, then its end
    assert spy.calls[5][0] == "eval" and spy.calls[6][0] == "log"               # the held-out line after step 2
    assert not (out / "metrics.jsonl").exists()          # the callbacks passed replace the standard set


def test_the_standard_set_writes_metrics_jsonl_from_the_same_records_a_callback_gets(tiny_config, tmp_path):
    cfg = config(tiny_config, log_every=2, eval_steps=3)
    out, spy, rollouts = tmp_path / "out", Spy(), Rollouts()
    out.mkdir()
    callbacks = [*results.run_callbacks(cfg, out, print, Ranks()), spy]
    train_loop(cfg, LoopState(), 6, Trainer(), rollouts, saver(out, []), callbacks, evaluate=evaluator())
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines == [record for (record,) in spy.of("log")]
    logged = [line for line in lines if "loss" in line]
    assert [line["step"] for line in logged] == [2, 4, 6]                           # logging.log_every
    assert [line["loss"] for line in logged] == [LOSSES[1], LOSSES[3], LOSSES[5]]
    assert [line["eval_loss"] for line in lines if "eval_loss" in line] == EVALS[:2]     # steps 3 and 6
    assert all(line["elapsed"] >= 0 for line in lines)
    # The sampler's numbers join the steps that made batches (odd ones here), its completions go to on_samples.
    steps = dict(spy.of("step"))
    assert [steps[s].get("reward") for s in range(1, 7)] == [0.25, None, 0.75, None, 1.25, None]
    assert "time/training" in steps[1] and "time/training" not in steps[2]
    assert [(s, [x["completion"] for x in samples]) for s, samples in spy.of("samples")] == [
        (1, ["c1"]), (3, ["c3"]), (5, ["c5"])]


def test_resuming_cuts_metrics_jsonl_back_and_tells_the_callbacks_where_it_starts(tiny_config, tmp_path):
    cfg = config(tiny_config)
    out = tmp_path / "out"
    out.mkdir()
    rows = [{"step": s, "loss": 9.0} for s in range(1, 6)]           # a run that died after step 5, checkpointed at 3
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spy = Spy()
    state = LoopState(step=3)
    trainer = Trainer()
    trainer.calls = 3
    train_loop(cfg, state, 6, trainer, Batches(), saver(out, []), [*results.run_callbacks(cfg, out, print, Ranks()), spy])
    assert spy.calls[0] == ("start", 6, 3)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["loss"]) for line in lines] == [(1, 9.0), (2, 9.0), (3, 9.0), (4, LOSSES[3]),
                                                               (5, LOSSES[4]), (6, LOSSES[5])]


def test_the_end_is_heard_when_the_loop_fails(tiny_config, tmp_path):
    cfg = config(tiny_config)
    out, spy = tmp_path / "out", Spy()
    out.mkdir()
    with pytest.raises(OutOfDeviceMemory, match="step 3: out of memory"):
        train_loop(cfg, LoopState(), 6, Trainer(fail_at=2), Batches(), saver(out, []), [spy])
    assert [s for s, _ in spy.of("step")] == [1, 2] and spy.calls[-1] == ("end",)


def test_early_stopping_saves_and_is_heard_before_the_end(tiny_config, tmp_path):
    cfg = config(tiny_config, eval_steps=1, early_stopping_patience=1, save_steps=100)
    out, spy, said = tmp_path / "out", Spy(), []
    out.mkdir()
    values = iter([1.0, 2.0, 0.5])

    def evaluate():
        value = next(values)
        return value, {"eval_loss": value}

    assert train_loop(cfg, LoopState(), 6, Trainer(), Batches(), saver(out, []), [spy], evaluate=evaluate,
                      echo=said.append) is True
    assert [s for s, _ in spy.of("eval")] == [1, 2]
    assert spy.of("checkpoint") == [(2, out / "checkpoint-2")] and spy.calls[-1] == ("end",)
    assert said and said[0].startswith("early stopping at step 2")


def test_run_takes_callbacks_that_hear_the_whole_run_after_its_own(tiny_config, tmp_path):
    """The public `run(cfg, backend, callbacks=[...])`: a callback hears every step with the numbers the run
    returns, and comes after the run's own (metrics.jsonl is written before it hears a line)."""
    from mudpuppy import create_backend, run

    class Reader(Spy):
        def on_log(self, record):
            super().on_log(record)
            written = (out / "metrics.jsonl").read_text().splitlines()
            self.calls.append(("written", json.loads(written[-1]) == record))

    cfg = config(tiny_config, save_steps=3)
    out, spy = Path(cfg.output_dir), Reader()
    result = run(cfg, create_backend("cpu"), echo=lambda *_: None, callbacks=[spy])
    assert spy.calls[0] == ("start", 6, 0) and spy.calls[-1] == ("end",)
    assert [m["loss"] for _, m in spy.of("step")] == result.losses and len(result.losses) == 6
    assert [s for s, _ in spy.of("checkpoint")] == [3, 6]
    assert spy.of("written") and all(same for (same,) in spy.of("written"))
