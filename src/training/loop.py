"""The training loop every recipe shares, written out in one function, `train_loop`.

A recipe (sft.py; runner.py for preference, reward and PRM; grpo.py; qat.py)
sets up its data, model, trainer and loop state, then calls

    train_loop(cfg, state, steps, trainer, batcher, checkpoints, callbacks, evaluate=..., objective=...)

Each optimizer step reads top to bottom there: the learning rate from the
schedule (schedule.py), the micro-batches from the batcher (data/batching.py),
the runtime's step (backends/<runtime>/trainer.py: forward, loss, backward,
clipping, the optimizer), the loop state advanced, the callbacks told
(monitor/callbacks.py), the held-out check with early stopping, the
checkpoint. What differs per method comes in as objects: the `objective` the
trainer minimises (None: SFT's token loss) and `evaluate`, which measures
held-out data. The state the loop carries is explicit: `LoopState` (saved in
every checkpoint, beside the trainer's optimizer and RNG state); Ctrl-C and
SIGTERM stop between steps so that a checkpoint resumes exactly.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

from ..data.tokenizers import save_tokenizer
from .. import files
from ..data import Batcher
from ..distributed import Ranks
from ..errors import MudpuppyError, OutOfDeviceMemory
from ..memory.fit import out_of_memory
from ..monitor.callbacks import Callback, Callbacks
from ..output_dir.rundir import STAGING_FINAL, publish_staged, record
from . import checkpoints, results
from .schedule import learning_rate


class TrainingDiverged(MudpuppyError):
    exit_code = 3


class Interrupted(MudpuppyError):
    exit_code = 130


# Moved to results.py (what a run returns and writes); kept here for the recipes that import them from the loop
# (qat.py, gptq.py).
RunResult, run_summary = results.RunResult, results.run_summary


@dataclass
class LoopState:
    """Everything the loop carries from step to step; saved in each checkpoint."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    tokens_seen: int = 0
    train_time: float = 0.0
    skipped: int = 0
    best_eval: float | None = None
    evals_without_gain: int = 0
    before: dict | None = None

    def as_dict(self, batcher: Batcher) -> dict:
        return {**self.__dict__, "batcher": batcher.state_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> "LoopState":
        fields = {k: v for k, v in data.items() if k != "batcher"}
        return cls(**fields)


# What `evaluate` returns: the number early stopping watches (lower is better) and what to log.
Evaluate = Callable[[], tuple[float, dict]]


@runtime_checkable
class Sampler(Protocol):
    """A batcher that makes its batches (GRPO's rollouts) and reports what making them showed."""

    def pop_metrics(self) -> dict[str, float]:
        """The numbers of batches made during the step that just ran (empty when none were)."""

    def pop_samples(self) -> list[dict]:
        """A few of the completions those batches were made from (empty when none were)."""


@dataclass
class Checkpoints:
    """Where the loop's checkpoints go, and how one is written: `write(state)` returns the complete
    checkpoint's path, or None where this process writes none (checkpoint_writer makes the usual one)."""

    out: Path
    write: Callable[[LoopState], Path | None]
    ranks: Ranks = field(default_factory=Ranks)     # the run's processes (one unless a launcher started several)

    def save(self, state: LoopState, report: Callback):
        """Write the checkpoint of state.step; the callbacks hear of it once it is complete."""
        path = self.write(state)
        if path is not None:
            report.on_checkpoint(state.step, Path(path))
        return path

    def newest(self) -> Path | None:
        """The newest complete checkpoint: where a resume would start."""
        return checkpoints.newest_complete(self.out)


def train_loop(cfg, state: LoopState, steps: int, trainer, batcher, checkpoints: Checkpoints,
               callbacks: list[Callback], evaluate: Evaluate | None = None, objective=None, echo=print) -> bool:
    """Optimizer steps from state.step to `steps`, each written out below; True when early stopping ended them.

    `trainer` runs one step on its runtime (backends/<runtime>/trainer.py: forward, loss, backward, clip,
    optimizer); `objective` is the loss it minimises (None: SFT's token loss). `evaluate` measures held-out
    data for early stopping. A batcher that samples its batches (GRPO's rollouts, a `Sampler`) adds what
    sampling showed to each step's metrics. Every number goes to `callbacks`, in order."""
    t = cfg.training
    report = Callbacks(callbacks)
    sampler = batcher if isinstance(batcher, Sampler) else None
    last_saved = state.step
    with GracefulStop(echo, checkpoints.ranks.distributed) as stop:
        report.on_run_start(steps, state.step)
        record = Record()
        try:
            while state.step < steps:
                step = state.step
                lr = learning_rate(t, step, steps)                  # the schedule (schedule.py)
                micro = [batcher.next_batch() for _ in range(t.gradient_accumulation_steps)]
                t0 = time.perf_counter()
                # forward, loss, backward, clipping and the optimizer's update, on the runtime
                res = trainer.step(micro, lr) if objective is None else trainer.step(micro, lr, objective)
                dt = time.perf_counter() - t0
                if res.skipped:
                    state.skipped += 1
                    if t.on_nan == "stop":
                        raise diverged(step, res, checkpoints.newest() if last_saved else None)
                state.step += 1
                state.train_time += dt
                state.tokens_seen += res.tokens
                state.losses.append(res.loss)
                state.lrs.append(lr)
                # what the step showed, to the callbacks
                made = sampler.pop_metrics() if sampler is not None else {}
                samples = sampler.pop_samples() if sampler is not None else []
                if samples:
                    report.on_samples(state.step, samples)
                if state.step % cfg.logging.log_every == 0 or state.step == steps:
                    report.on_log(record.step_line(state.step, res, lr, dt, batcher.epoch, made))
                report.on_step_end(state.step, step_metrics(res, lr, dt, batcher.epoch, made))
                # held-out check (early stopping), then the checkpoint
                if t.eval_steps and state.step % t.eval_steps == 0 and evaluate is not None:
                    if check_patience(cfg, state, evaluate, report, record, echo):
                        checkpoints.save(state, report)
                        return True
                if t.save_steps and state.step % t.save_steps == 0:
                    checkpoints.save(state, report)
                    last_saved = state.step
                if stop.requested:
                    # The last step too: what comes after training (saving, evaluation, merge) can take minutes,
                    # and the user asked to stop; --resume runs no step and finishes the run.
                    path = checkpoints.save(state, report) if state.step > last_saved else checkpoints.newest()
                    raise stop.stopped(stopped_after(state.step, steps, path))
        except OutOfDeviceMemory as exc:
            raise out_of_memory(exc, state.step, checkpoints.newest()) from exc
        except KeyboardInterrupt:
            raise stop.stopped(stopped_at_once(state.step, checkpoints.newest())) from None
        finally:
            report.on_run_end()
    if t.save_steps and last_saved != state.step:
        checkpoints.save(state, report)         # the last step's, outside the Ctrl-C handling, after on_run_end
    return False


def diverged(step: int, res, newest: Path | None) -> TrainingDiverged:
    where = f"; the last good checkpoint is {newest}" if newest else ""
    return TrainingDiverged(f"step {step + 1}: non-finite loss or gradient (loss {res.loss}, grad norm "
                            f"{res.grad_norm}); stopped with weights untouched (training.on_nan: stop){where}")


def stopped_after(step: int, steps: int, path) -> str:
    """What a stop asked for between steps says (GracefulStop.stopped names the signal)."""
    left = "" if step < steps else " (training is done; --resume saves, evaluates and merges)"
    return (f"after step {step} of {steps}; checkpoint saved to {path}{left}. "
            "Continue with: mudpuppy run --config ... --resume")


def stopped_at_once(step: int, newest: Path | None) -> str:
    """Stopped at once, possibly mid-step: what is in memory may be half updated, so nothing is saved; the
    newest complete checkpoint is where a resume starts."""
    where = f"the newest complete checkpoint is {newest}" if newest else "no checkpoint had been written yet"
    return (f"and stopped at once during step {step + 1}; nothing was saved; {where}. "
            "Continue with: mudpuppy run --config ... --resume")


class Record:
    """The lines of the run's record (metrics.jsonl), each with `elapsed`: seconds since the loop started."""

    def __init__(self):
        self.start = time.perf_counter()

    def line(self, **fields) -> dict:
        return {**fields, "elapsed": round(time.perf_counter() - self.start, 3)}

    def step_line(self, step: int, res, lr: float, dt: float, epoch, made: dict) -> dict:
        """A step's line: rounded, NaN as null; a step that made batches says how long its training took."""
        return self.line(step=step, loss=round(res.loss, 6), lr=lr, tokens=res.tokens,
                         tokens_per_second=round(res.tokens / dt, 1), grad_norm=res.grad_norm,
                         skipped=res.skipped, epoch=epoch,
                         **{k: rounded(v) for k, v in {**made, **res.metrics}.items()},
                         **({"time/training": round(dt, 3)} if made else {}))


def step_metrics(res, lr: float, dt: float, epoch, made: dict) -> dict:
    """Every step's numbers as on_step_end gets them: those of its record line, unrounded."""
    return {"loss": res.loss, "lr": lr, "tokens": res.tokens, "tokens_per_second": res.tokens / dt,
            "grad_norm": res.grad_norm, "skipped": res.skipped, "epoch": epoch, **made, **res.metrics,
            **({"time/training": dt} if made else {})}


def rounded(value: float) -> float | None:
    """A metric for metrics.jsonl: 6 decimals, and NaN (no value this step) as null, which JSON can hold."""
    return None if value != value else round(value, 6)


def check_patience(cfg, state: LoopState, evaluate: Evaluate, report: Callbacks, record: Record, echo) -> bool:
    """Measure held-out data; True when it has stopped improving for `early_stopping_patience` evals."""
    t = cfg.training
    value, fields = evaluate()
    report.on_eval_end(state.step, fields)
    report.on_log(record.line(step=state.step, **fields))
    if state.best_eval is None or value < state.best_eval - t.early_stopping_min_delta:
        state.best_eval, state.evals_without_gain = value, 0
    else:
        state.evals_without_gain += 1
    if t.early_stopping_patience and state.evals_without_gain >= t.early_stopping_patience:
        echo(f"early stopping at step {state.step}: held-out loss {value:.4f} has not improved on "
             f"{state.best_eval:.4f} for {state.evals_without_gain} evaluations")
        return True
    return False


def total_steps_for(cfg, batcher: Batcher) -> int:
    t = cfg.training
    if t.max_steps:
        return t.max_steps
    micro = math.ceil(t.epochs * batcher.batches_per_epoch)
    return max(1, math.ceil(micro / t.gradient_accumulation_steps))


def checkpoint_identity(cfg) -> dict:
    """What a checkpoint must share with the config that resumes it."""
    identity = {"base_model": cfg.model.base_model, "method": cfg.method,
                "adapter": cfg.adapter.model_dump(mode="json", exclude={"dropout"})}
    if cfg.method != "sft":
        identity["objective"] = cfg.data_method()     # dpo and kto checkpoints do not mix
    return identity


class GracefulStop:
    """Ctrl-C and SIGTERM handling for the loop: the first signal asks to stop after the step in progress
    and save a checkpoint, a second one stops at once.

    SIGTERM is how schedulers and clouds stop a job (SLURM's time limit, Kubernetes, a preempted spot
    instance, `kill`), with SIGKILL after a grace period: the step in progress finishes and its checkpoint
    is written inside that period where it fits, and `--resume` continues from it.

    Stopping between steps is what makes the saved checkpoint exact: mid-step, the
    optimizer update may be half applied and dropout's RNG has moved on, so a
    checkpoint written then would not resume to the run that was interrupted.
    """

    SIGNALS = {signal.SIGINT: ("interrupted", "Ctrl-C", 130), signal.SIGTERM: ("terminated", "SIGTERM", 143)}

    def __init__(self, echo, distributed: bool = False):
        self.echo, self.requested, self.previous, self.received = echo, False, {}, signal.SIGINT
        # One rank of several: torchrun / mlx.launch send SIGTERM when a peer failed, and finishing the step
        # would wait on that peer's collectives; the launcher's SIGTERM keeps its default, ending the rank.
        self.signals = [signal.SIGINT] if distributed else list(self.SIGNALS)

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._on_signal) for sig in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.received = True, signum
        _, name, _ = self.SIGNALS[signum]
        self.echo(f"\n{name}: stopping after this step to save a checkpoint (Ctrl-C or SIGTERM again to stop at once, "
                  "without saving)")

    def stopped(self, message: str) -> "Interrupted":
        """The error that ends the run, named by the signal that asked for it, with its shell exit code."""
        what, _, code = self.SIGNALS[self.received]
        error = Interrupted(f"{what} {message}")
        error.exit_code = code
        return error


def checkpoint_writer(cfg, backend, handle, trainer, batcher, out,
                      recorded: Callable[[], dict] | None = None) -> Checkpoints:
    """Checkpoints of the run in `out`: the loop state, the batcher's position, and the backend's training state
    (weights, optimizer, RNG). `recorded()`: what else each checkpoint's marker records (session.py: what the
    run was trained with)."""
    identity, ranks = checkpoint_identity(cfg), backend.ranks

    def save(state: LoopState) -> Path:
        if ranks.is_main:
            record(out, [checkpoints.DIRNAME])      # listed in the run's marker before it is written
        return checkpoints.save_checkpoint(
            out, state.step, {**identity, **(recorded() if recorded else {})}, state.as_dict(batcher),
            lambda d: backend.save_training_state(handle, trainer, str(d)), cfg.training.keep_last_n, ranks)

    return Checkpoints(Path(out), save, ranks)


def restore(cfg, backend, handle, trainer, batcher, path: Path) -> LoopState:
    data = checkpoints.read_checkpoint(path, checkpoint_identity(cfg))
    backend.load_training_state(handle, trainer, str(path))
    batcher.load_state_dict(data["batcher"])
    return LoopState.from_dict(data)


def resumed_step(resume_from: Path | None) -> int | None:
    return int(resume_from.name.split("-")[1]) if resume_from else None


def save_trained(cfg, backend, handle, out: Path) -> None:
    """The run's result in output_dir: the adapter (and tokenizer), or the whole model."""
    with staged_final(out, backend.ranks) as stage:
        if cfg.adapter.type == "none":
            backend.save_model(handle, str(stage))
        else:
            backend.save_adapter(handle, str(stage))       # collective in a distributed run; rank 0 writes
            if backend.ranks.is_main:
                save_tokenizer(handle.tokenizer, stage)


@contextlib.contextmanager
def staged_final(out: Path, ranks: Ranks):
    """Where the run's result is written first: a staging directory inside output_dir, whose files are
    renamed into output_dir only once all of them are written. A save that fails (a full disk) leaves
    output_dir as it was (no tokenizer.json cut short beside a good adapter) and ends in one message;
    the staging directory goes. In a distributed run rank 0 alone creates, moves and removes it."""
    out = Path(out)
    stage = out / STAGING_FINAL
    main = ranks.is_main
    if main:
        if stage.exists():                  # left by a process killed mid-save
            shutil.rmtree(stage)
        stage.mkdir(parents=True)
    newest = checkpoints.newest_complete(out)
    kept = (f"nothing in {out} was replaced; the newest checkpoint, {newest}, holds the trained weights: free "
            "space, then run again with --resume" if newest else f"nothing in {out} was replaced")
    with files.write_errors(f"saving the trained model to {out}", out, cleanup=stage if main else None, kept=kept):
        yield stage
        if main:
            publish_staged(stage, out)         # recorded in the run's marker, then renamed in
