"""The training loop every recipe shares: steps, checkpoints, held-out checks, resume.

A recipe (sft.py, preference.py, reward.py) sets up its data, model and
objective, then hands them to `train_loop`. What differs per method comes
in as two callables: the `objective` the trainer minimises (None: SFT's
token loss) and `evaluate`, which measures held-out data for early
stopping. Everything else is written once here: the schedule, gradient
accumulation, non-finite steps, atomic checkpoints with exact resume and
Ctrl-C. What the loop measures goes to its callbacks (monitor/callbacks.py):
metrics.jsonl, the trackers and the progress display unless the recipe
passes its own list; the loop knows nothing of what they do.
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
from typing import Callable, Protocol

from ..data.tokenizers import save_tokenizer
from .. import files
from ..data import Batcher
from ..distributed import current as current_ranks
from ..errors import MudpuppyError, OutOfDeviceMemory
from ..monitor.callbacks import Callback, Callbacks
from . import checkpoints, outputs
from .rundir import STAGING_FINAL, publish_staged, record
from .schedule import learning_rate

class TrainingDiverged(MudpuppyError):
    exit_code = 3


class Interrupted(MudpuppyError):
    exit_code = 130


# Moved to outputs.py (what a run returns and writes); kept here for the recipes that import them from the loop
# (qat.py, gptq.py).
RunResult, run_summary = outputs.RunResult, outputs.run_summary


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


class Sampler(Protocol):
    """A batcher that makes its batches (GRPO's rollouts) and reports what making them showed."""

    def pop_metrics(self) -> dict[str, float]:
        """The numbers of batches made during the step that just ran (empty when none were)."""

    def pop_samples(self) -> list[dict]:
        """A few of the completions those batches were made from (empty when none were)."""


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


def train_loop(cfg, trainer, batcher, state: LoopState, steps: int, save, out: Path, echo,
               objective=None, evaluate: Evaluate | None = None, callbacks: list[Callback] | None = None,
               sampler: Sampler | None = None) -> bool:
    """Run optimizer steps from state.step to `steps`; True when early stopping ended it. `callbacks` hear
    what happens (default: outputs.run_callbacks, built from the config); `sampler`, when the batcher makes its
    batches, adds what making them showed to each step's metrics (GRPO passes its rollouts)."""
    if callbacks is None:
        callbacks = outputs.run_callbacks(cfg, out, echo)
    with GracefulStop(echo, current_ranks().distributed) as stop:
        return _run_steps(cfg, trainer, batcher, state, steps, save, out, echo, objective, evaluate, stop,
                          Callbacks(callbacks), sampler)


def _run_steps(cfg, trainer, batcher, state, steps, save, out, echo, objective, evaluate, stop, report: Callbacks,
               sampler) -> bool:
    t = cfg.training
    report.on_run_start(steps, state.step)
    record = Record()
    last_saved = state.step
    try:
        while state.step < steps:
            step = state.step
            lr = learning_rate(t, step, steps)
            micro = [batcher.next_batch() for _ in range(t.gradient_accumulation_steps)]
            t0 = time.perf_counter()
            res = trainer.step(micro, lr) if objective is None else trainer.step(micro, lr, objective)
            dt = time.perf_counter() - t0
            if res.skipped:
                state.skipped += 1
                if t.on_nan == "stop":
                    where = f"; the last good checkpoint is {checkpoints.newest_complete(out)}" if last_saved else ""
                    raise TrainingDiverged(
                        f"step {step + 1}: non-finite loss or gradient (loss {res.loss}, grad norm {res.grad_norm}); "
                        f"stopped with weights untouched (training.on_nan: stop){where}")
            state.step += 1
            state.train_time += dt
            state.tokens_seen += res.tokens
            state.losses.append(res.loss)
            state.lrs.append(lr)
            made = sampler.pop_metrics() if sampler is not None else {}
            samples = sampler.pop_samples() if sampler is not None else []
            if samples:
                report.on_samples(state.step, samples)
            if state.step % cfg.logging.log_every == 0 or state.step == steps:
                report.on_log(record.step_line(state.step, res, lr, dt, batcher.epoch, made))
            report.on_step_end(state.step, step_metrics(res, lr, dt, batcher.epoch, made))
            if t.eval_steps and state.step % t.eval_steps == 0 and evaluate is not None:
                if check_patience(cfg, state, evaluate, report, record, echo):
                    save_and_report(save, state, report)
                    return True
            if t.save_steps and state.step % t.save_steps == 0:
                save_and_report(save, state, report)
                last_saved = state.step
            if stop.requested:
                # The last step too: what comes after training (saving, evaluation, merge) can take minutes,
                # and the user asked to stop; --resume runs no step and finishes the run.
                path = save_and_report(save, state, report) if state.step > last_saved \
                    else checkpoints.newest_complete(out)
                left = "" if state.step < steps else " (training is done; --resume saves, evaluates and merges)"
                raise stop.stopped(f"after step {state.step} of {steps}; checkpoint saved to {path}{left}. "
                                   "Continue with: mudpuppy run --config ... --resume")
    except OutOfDeviceMemory as exc:
        # Nothing of this step is saved; the newest complete checkpoint is where a resume starts.
        newest = checkpoints.newest_complete(out)
        where = (f"the newest complete checkpoint, {newest}, is kept: continue from it with --resume once the run fits"
                 if newest else "no checkpoint had been written yet (training.save_steps writes them)")
        raise OutOfDeviceMemory(f"step {state.step + 1}: {exc} Nothing of this step was saved; {where}.") from exc
    except KeyboardInterrupt:
        # Stopped at once, possibly mid-step: what is in memory may be half updated, so
        # nothing is saved; the newest complete checkpoint is where a resume starts.
        newest = checkpoints.newest_complete(out)
        where = f"the newest complete checkpoint is {newest}" if newest else "no checkpoint had been written yet"
        raise stop.stopped(f"and stopped at once during step {state.step + 1}; nothing was saved; {where}. "
                           "Continue with: mudpuppy run --config ... --resume") from None
    finally:
        report.on_run_end()
    if t.save_steps and last_saved != state.step:
        save_and_report(save, state, report)
    return False


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


def save_and_report(save, state: LoopState, report: Callbacks):
    """Write the checkpoint of state.step; the callbacks hear of it once it is complete."""
    path = save(state)
    if path is not None:
        report.on_checkpoint(state.step, Path(path))
    return path


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


def checkpoint_writer(cfg, backend, handle, trainer, batcher, out, recorded: Callable[[], dict] | None = None):
    """`recorded()`: what else each checkpoint's marker records (session.py: what the run was trained with)."""
    identity = checkpoint_identity(cfg)

    def save(state: LoopState) -> Path:
        record(out, [checkpoints.DIRNAME])          # listed in the run's marker before it is written
        return checkpoints.save_checkpoint(
            out, state.step, {**identity, **(recorded() if recorded else {})}, state.as_dict(batcher),
            lambda d: backend.save_training_state(handle, trainer, str(d)), cfg.training.keep_last_n)

    return save


def restore(cfg, backend, handle, trainer, batcher, path: Path) -> LoopState:
    data = checkpoints.read_checkpoint(path, checkpoint_identity(cfg))
    backend.load_training_state(handle, trainer, str(path))
    batcher.load_state_dict(data["batcher"])
    return LoopState.from_dict(data)


def resumed_step(resume_from: Path | None) -> int | None:
    return int(resume_from.name.split("-")[1]) if resume_from else None


def save_trained(cfg, backend, handle, out: Path) -> None:
    """The run's result in output_dir: the adapter (and tokenizer), or the whole model."""
    with staged_final(out) as stage:
        if cfg.adapter.type == "none":
            backend.save_model(handle, str(stage))
        else:
            backend.save_adapter(handle, str(stage))       # collective in a distributed run; rank 0 writes
            if current_ranks().is_main:
                save_tokenizer(handle.tokenizer, stage)


@contextlib.contextmanager
def staged_final(out: Path):
    """Where the run's result is written first: a staging directory inside output_dir, whose files are
    renamed into output_dir only once all of them are written. A save that fails (a full disk) leaves
    output_dir as it was (no tokenizer.json cut short beside a good adapter) and ends in one message;
    the staging directory goes. In a distributed run rank 0 alone creates, moves and removes it."""
    out = Path(out)
    stage = out / STAGING_FINAL
    main = current_ranks().is_main
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
