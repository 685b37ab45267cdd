"""The training loop every recipe shares: steps, logging, checkpoints, held-out checks, resume.

A recipe (sft.py, preference.py, reward.py) sets up its data, model and
objective, then hands them to `train_loop`. What differs per method comes
in as two callables: the `objective` the trainer minimises (None: SFT's
token loss) and `evaluate`, which measures held-out data for early
stopping. Everything else is written once here: the schedule, gradient
accumulation, non-finite steps, atomic checkpoints with exact resume,
Ctrl-C, and the metrics log.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..data.tokenizers import save_tokenizer
from .. import files
from ..data import Batcher
from ..distributed import current as current_ranks
from ..errors import MudpuppyError, OutOfDeviceMemory
from ..monitor.live import active as active_dashboard
from ..monitor.progress import plain_progress, progress_bar
from . import checkpoints, outputs
from .rundir import STAGING_FINAL
from .schedule import learning_rate
from .trackers import open_trackers

# Fault injection for the resume tests: SIGKILL this process right after the
# given step (and its checkpoint) completes, as a crash or OOM kill would; in a
# distributed run only the rank FAULT_RANK_ENV names (default: every rank).
FAULT_ENV = "MUDPUPPY_FAULT_AFTER_STEP"
FAULT_RANK_ENV = "MUDPUPPY_FAULT_RANK"


class TrainingDiverged(MudpuppyError):
    exit_code = 3


class Interrupted(MudpuppyError):
    exit_code = 130


@dataclass
class RunResult:
    output_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    before: object = None         # EvalResult (sft) or a method's own held-out result
    after: object = None
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    skipped_steps: int = 0
    stopped_early: bool = False
    resumed_from: int | None = None
    model: object = None          # the trained ModelHandle, for generation or further use in Python


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
    """Ctrl-C handling for the loop: the first press asks to stop after the step in progress,
    a second press stops at once.

    Stopping between steps is what makes the saved checkpoint exact: mid-step, the
    optimizer update may be half applied and dropout's RNG has moved on, so a
    checkpoint written then would not resume to the run that was interrupted.
    """

    def __init__(self, echo):
        self.echo, self.requested, self.previous = echo, False, None

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def _on_sigint(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.echo("\nstopping after this step to save a checkpoint (Ctrl-C again to stop at once, without saving)")


def train_loop(cfg, trainer, batcher, state: LoopState, steps: int, save, out: Path, echo,
               objective=None, evaluate: Evaluate | None = None) -> bool:
    with GracefulStop(echo) as stop:
        return _run_steps(cfg, trainer, batcher, state, steps, save, out, echo, objective, evaluate, stop)


def _run_steps(cfg, trainer, batcher, state, steps, save, out, echo, objective, evaluate, stop) -> bool:
    """Run optimizer steps from state.step to `steps`; True when early stopping ended it."""
    t = cfg.training
    main = current_ranks().is_main          # in a distributed run rank 0 alone logs
    log = outputs.MetricsLog(out, truncate_after=state.step, trackers=open_trackers(cfg, out)) if main \
        else outputs.NoLog()
    log, bar = watch_progress(cfg, log, steps, state.step, main)
    fault_step = fault_injection_step()
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
            # A batcher that makes its batches (GRPO's rollouts) reports what making them showed.
            made = batcher.pop_metrics() if hasattr(batcher, "pop_metrics") else {}
            # ... and a few of the completions it sampled, which the --tui dashboard shows.
            samples = batcher.pop_samples() if hasattr(batcher, "pop_samples") else []
            if samples and hasattr(bar, "show_samples"):
                bar.show_samples(samples)
            if state.step % cfg.logging.log_every == 0 or state.step == steps:
                log.write(step=state.step, loss=round(res.loss, 6), lr=lr, tokens=res.tokens,
                          tokens_per_second=round(res.tokens / dt, 1), grad_norm=res.grad_norm,
                          skipped=res.skipped, epoch=batcher.epoch,
                          **{k: rounded(v) for k, v in {**made, **res.metrics}.items()},
                          **({"time/training": round(dt, 3)} if made else {}))
            if bar is not None:
                shown = {"reward": f"{made['reward']:.3f}"} if "reward" in made else {}
                bar.set_postfix(loss=f"{res.loss:.4f}", tok_s=f"{res.tokens / dt:.0f}", **shown)
                bar.update(1)
            if t.eval_steps and state.step % t.eval_steps == 0 and evaluate is not None:
                if check_patience(cfg, state, evaluate, log, echo):
                    save(state)
                    return True
            if t.save_steps and state.step % t.save_steps == 0:
                save(state)
                last_saved = state.step
            if fault_step and state.step == fault_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if stop.requested and state.step < steps:
                path = save(state) if state.step > last_saved else checkpoints.newest_complete(out)
                raise Interrupted(f"interrupted after step {state.step}; checkpoint saved to {path}. "
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
        raise Interrupted(f"stopped at once during step {state.step + 1}; nothing was saved; {where}. "
                          "Continue with: mudpuppy run --config ... --resume") from None
    finally:
        if bar is not None:
            bar.close()
        log.close()
    if t.save_steps and last_saved != state.step:
        save(state)
    return False


def fault_injection_step() -> int:
    """The step after which the resume tests kill this process (0: never)."""
    rank = os.environ.get(FAULT_RANK_ENV, "")
    if rank != "" and int(rank) != current_ranks().rank:
        return 0
    return int(os.environ.get(FAULT_ENV, "0") or 0)


def rounded(value: float) -> float | None:
    """A metric for metrics.jsonl: 6 decimals, and NaN (no value this step) as null, which JSON can hold."""
    return None if value != value else round(value, 6)


def check_patience(cfg, state: LoopState, evaluate: Evaluate, log, echo) -> bool:
    """Measure held-out data; True when it has stopped improving for `early_stopping_patience` evals."""
    t = cfg.training
    value, fields = evaluate()
    log.write(step=state.step, **fields)
    if state.best_eval is None or value < state.best_eval - t.early_stopping_min_delta:
        state.best_eval, state.evals_without_gain = value, 0
    else:
        state.evals_without_gain += 1
    if t.early_stopping_patience and state.evals_without_gain >= t.early_stopping_patience:
        echo(f"early stopping at step {state.step}: held-out loss {value:.4f} has not improved on "
             f"{state.best_eval:.4f} for {state.evals_without_gain} evaluations")
        return True
    return False


def checkpoint_writer(cfg, backend, handle, trainer, batcher, out):
    identity = checkpoint_identity(cfg)

    def save(state: LoopState) -> Path:
        return checkpoints.save_checkpoint(
            out, state.step, identity, state.as_dict(batcher),
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
            files.move_into(stage, out)


def watch_progress(cfg, log, total: int, done: int, main: bool):
    """The metrics log and the progress display: the --tui dashboard's while one is drawing (rank 0 only),
    else progress_bar's. After a dashboard failure, plain lines take over from the step reached."""
    every, enabled = cfg.logging.progress_every, cfg.logging.progress_bar and main
    dash = active_dashboard() if main else None
    if dash is None:
        return log, progress_bar(total, done, enabled, every)

    def plain(reached: int):
        return plain_progress(total, reached, every, sys.stderr) if enabled else None

    return dash.watching(log), dash.progress(total, done, plain)


def run_summary(cfg, result: RunResult, info, n_train: int, n_val: int, **extra) -> dict:
    """What run_summary.json holds for every method; a recipe adds its own fields via `extra`. `base` is the
    exact base as this run resolved it (backends.provenance.base_record): how mudpuppy finds it again, the Hub
    id the adapter's config names, and where the weights truly came from."""
    from ..backends.provenance import base_record

    return {
        "status": "finished",
        "method": cfg.method,
        "adapter": info.kind,
        "base_model": cfg.model.base_model,
        "base": base_record(cfg.model.base_model, cfg.model.revision),
        "steps": result.steps,
        "first_loss": result.losses[0] if result.losses else None,
        "final_loss": result.losses[-1] if result.losses else None,
        "skipped_steps": result.skipped_steps,
        "stopped_early": result.stopped_early,
        "resumed_from_step": result.resumed_from,
        "trainable_params": info.trainable_params,
        "train_examples": n_train,
        "val_examples": n_val,
        **extra,
        "tokens_per_second": round(result.tokens_per_second, 1),
        "seconds": round(result.seconds, 1),
        "eval_before": result.before.as_dict() if result.before else None,
        "eval_after": result.after.as_dict() if result.after else None,
    }
