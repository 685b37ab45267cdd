"""The setup and the end every training recipe shares; the loop between them stays in the recipe.

A recipe (sft.py, runner.py for preference / reward / PRM, grpo.py, qat.py) reads and checks its data
first, so that a data problem costs nothing, then:

    run = start_run(cfg, backend, overwrite, echo, started, callbacks)   output_dir claimed (locked; a run that
                                                                --overwrite replaces stays), a resume's
                                                                changed settings checked, seed, model
    ... the method's data, tokenized with run.handle.tokenizer
    run.take_output_dir()                                       the replaced run goes, the config copy comes
    run.measure_before(measure)                                 held-out numbers before training
    run.attach_adapter()                                        with its two lines of output
    trainer = backend.create_trainer(run.handle, cfg.training); batcher = ...
    steps = run.restore(trainer, batcher)                       a resumed run's state back from its checkpoint
                                                                (the next older one when it does not load)
    stopped_early = train_loop(cfg, run.state, steps, trainer, batcher, run.checkpoints(trainer, batcher),
                               run.callbacks(), evaluate=..., objective=...)
    ... save what was trained
    result = run.result(stopped_early, trainer)
    result.after = run.measure_after(measure)
    return run.finish(result, n_train, n_val, **summary_fields)  merge, memory, seconds, run_summary.json

GPTQ trains nothing (no adapter, trainer or checkpoints) and keeps its own order: it loads the model
before it claims output_dir.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import files
from ..errors import MudpuppyError
from ..evaluation.result import EvalResult
from ..memory.phases import MemoryPhases, with_memory
from ..output_dir import Claim, claim_output_dir, take_output_dir
from ..output_dir.rundir import CONFIG
from . import checkpoints, results, resume_changes
from .loop import Checkpoints, LoopState, checkpoint_writer, restore, resumed_step, total_steps_for
from .merge import merge_at_end
from .results import RunResult

Measure = Callable[[], EvalResult]      # one held-out evaluation of the model as it is now


@dataclass
class Run:
    """One training run between its start (output_dir claimed, model loaded) and run_summary.json."""

    cfg: object
    backend: object
    echo: Callable
    claim: Claim
    started: float                              # time.perf_counter() when the recipe began
    handle: object                              # the loaded model (protocol.ModelHandle)
    state: LoopState = field(default_factory=LoopState)
    info: object = None                         # the attached adapter (protocol.AdapterInfo)
    memory: MemoryPhases | None = None          # peak device memory by phase, once the loop has callbacks
    record: dict = field(default_factory=dict)  # what trains this run (resume_changes.trained_with)
    changes: list[dict] = field(default_factory=list)   # settings changed at a resume: earlier ones, then this one's
    accepted: list[dict] = field(default_factory=list)  # those this resume accepted
    extra: list = field(default_factory=list)   # the callbacks the caller of run() added (monitor/callbacks.py)

    @property
    def ranks(self):
        """This process's place in the run (distributed.Ranks), as the backend joined it."""
        return self.backend.ranks

    @property
    def out(self) -> Path:
        return self.claim.out

    @property
    def resume_from(self) -> Path | None:
        return self.claim.resume_from

    def take_output_dir(self) -> Path:
        """Once the model and data have loaded: the run --overwrite replaces goes, the config copy comes. A
        resumed run keeps the config.yaml it started with: what a resume changed is recorded as a change at
        its step (resume_changes.py), never as the config of the whole run."""
        started_with = self._config_copy() if self.resume_from is not None else None
        out = take_output_dir(self.cfg, self.claim, self.echo, ranks=self.ranks)
        if started_with is not None and self.ranks.is_main:
            path = out / CONFIG
            staged = path.with_name(path.name + ".tmp")
            staged.write_bytes(started_with)
            os.replace(staged, path)
        return out

    def _config_copy(self) -> bytes | None:
        try:
            return (self.out / CONFIG).read_bytes()
        except OSError:
            return None

    def measure_before(self, measure: Measure | None) -> None:
        """Held-out numbers before training (eval.before_training, where there is held-out data: `measure`
        not None), kept in the loop state and so in every checkpoint: a resumed run has them already."""
        if self.cfg.eval.before_training and measure is not None and self.resume_from is None:
            before = measure()
            self.state.before = before.as_dict()
            self.echo(f"before training: {before.describe()}")

    def attach_adapter(self, batches=None):
        """The adapter on the model; `batches`, the training batches adapter.init eva decomposes."""
        extra = {"batches": batches} if batches is not None else {}
        self.info = self.backend.attach_adapter(self.handle, self.cfg.adapter, **extra)
        self.echo(f"model: {self.handle.describe()}")
        self.echo(f"adapter: {self.info.describe()}")
        return self.info

    def restore(self, trainer, batcher) -> int:
        """The run's total optimizer steps; a resumed run first gets its weights, optimizer, data position
        and loop state back from the checkpoint it resumes. One whose damage shows only while it loads is
        skipped with one line for the next older one that reads, whose settings are checked in turn."""
        steps = total_steps_for(self.cfg, batcher)
        while self.resume_from is not None:
            try:
                self.state = restore(self.cfg, self.backend, self.handle, trainer, batcher, self.resume_from)
                break
            except Exception as exc:      # noqa: BLE001 - _damaged_while_loading decides; anything else re-raised
                if not _damaged_while_loading(exc):
                    raise
                self._fall_back(exc)
        if self.resume_from is not None:
            self.echo(f"resumed from {self.resume_from} (step {self.state.step} of {steps})")
        return steps

    def _fall_back(self, exc: Exception) -> None:
        """Resume from the checkpoint before the one that did not load: every trainable weight, the optimizer,
        the RNG and the data position load again from it, so a half-finished load leaves nothing behind."""
        failed = self.resume_from
        reason = checkpoints.skip_unloadable(failed, exc)
        older = None if self.ranks.distributed else checkpoints.older_checkpoint(self.out, failed)
        if older is None:
            why = ("a distributed run does not fall back (its processes would have to agree on which)"
                   if self.ranks.distributed else "no older checkpoint reads")
            raise files.CorruptFile(f"cannot resume from {failed}: {reason}, and {why}. It is kept as it is; "
                                    "start over with --overwrite or a new output_dir") from exc
        self.accepted = resume_changes.check_resume(self.cfg, self.record, older, self.echo)
        self.changes = resume_changes.history_of(older) + self.accepted
        self.claim.resume_from = older

    def checkpoints(self, trainer, batcher) -> Checkpoints:
        """Each checkpoint also records what trained it and the changes accepted so far (resume_changes.py)."""
        return checkpoint_writer(self.cfg, self.backend, self.handle, trainer, batcher, self.out,
                                 recorded=lambda: {resume_changes.RECORD: self.record,
                                                   resume_changes.HISTORY: self.changes})

    def callbacks(self) -> list:
        """What the loop reports to: results.run_callbacks, the peak memory of each phase (run_summary.json's
        `memory`, memory/phases.py), then the callbacks the caller of run() added."""
        self.memory = MemoryPhases(self.backend)
        callbacks = results.run_callbacks(self.cfg, self.out, self.echo, self.ranks)
        return [*callbacks, *resume_changes.changes_line(callbacks, self.accepted), self.memory, *self.extra]

    def result(self, stopped_early: bool, trainer) -> RunResult:
        """What the loop did, with the numbers from before training (from the checkpoint when resumed). The
        trained weights are saved and the last checkpoint written: the trainer releases its optimizer state
        and gradients, so the evaluation and the merge after training have that memory."""
        if trainer is not None:
            trainer.release()
        state = self.state
        result = RunResult(self.out, state.step, state.losses, state.lrs, skipped_steps=state.skipped,
                           stopped_early=stopped_early, model=self.handle, resumed_from=resumed_step(self.resume_from))
        result.before = EvalResult.from_dict(state.before) if state.before else None
        result.tokens_per_second = state.tokens_seen / max(state.train_time, 1e-9)
        return result

    def measure_after(self, measure: Measure | None, count: bool = True) -> EvalResult | None:
        """Held-out numbers of what was saved (eval.after_training, where there is held-out data)."""
        if not (self.cfg.eval.after_training and measure is not None):
            return None
        after = measure()
        self.echo(f"after training:  {after.describe(count)}")
        return after

    def finish(self, result: RunResult, n_train: int, n_val: int, merge: bool = True, **extra) -> RunResult:
        """The memory of the evaluation after training, merge: true (`merge` False: the recipe merges its own
        way, or has nothing to merge) and its memory, the run's time, then run_summary.json with the recipe's
        `extra` fields: the last file a run writes."""
        if self.memory is not None:
            self.memory.record("after_training")
        if merge and merge_at_end(self.cfg, self.backend, self.out, self.echo) and self.memory is not None:
            self.memory.record("merge")
        result.seconds = time.perf_counter() - self.started
        summary = results.run_summary(self.cfg, result, self.info, n_train, n_val,
                                      **{resume_changes.HISTORY: self.changes, **extra})
        written = summary if self.memory is None else with_memory(summary, self.memory)
        results.write_summary(self.out, self.ranks, written)
        return result


def start_run(cfg, backend, overwrite: bool, echo, started: float, callbacks=(), head: str | None = None) -> Run:
    """Claim output_dir (locked; a run that --overwrite replaces stays until take_output_dir), check what a
    resume changes (resume_changes.py: refused unless allowed), seed, load the model (with a scalar `head` for
    reward models): after the recipe's data checks, before its tokenization. `callbacks`: what the caller of
    run() added, heard by the loop after the run's own (Run.callbacks)."""
    claim = claim_output_dir(cfg, overwrite, backend.ranks)
    record = resume_changes.trained_with(cfg, backend.ranks)
    accepted = resume_changes.check_resume(cfg, record, claim.resume_from, echo) if claim.resume_from else []
    history = resume_changes.history_of(claim.resume_from) if claim.resume_from else []
    backend.seed(cfg.training.seed)
    handle = backend.load_model(cfg.model, cfg.training.precision, head=head, adapter=cfg.adapter)
    return Run(cfg, backend, echo, claim, started, handle, record=record, changes=history + accepted,
               accepted=accepted, extra=list(callbacks))


def _damaged_while_loading(exc: Exception) -> bool:
    """A load failure that says the checkpoint is damaged: a file the checks named, or an error the runtime
    raised reading bytes that are not what was written. A user error (a config the checkpoint does not fit)
    and running out of memory are not: the next older checkpoint would fail the same way."""
    if isinstance(exc, files.CorruptFile):
        return True
    if isinstance(exc, (MudpuppyError, MemoryError)) or "OutOfMemory" in type(exc).__name__:
        return False
    return not isinstance(exc, CODING_ERRORS)


# Raised by mudpuppy's own code, not by bytes it reads: a bug keeps its traceback.
CODING_ERRORS = (AttributeError, NameError, ImportError, AssertionError, NotImplementedError)
