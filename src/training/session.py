"""The setup and the end every training recipe shares; the loop between them stays in the recipe.

A recipe (sft.py, runner.py for preference / reward / PRM, grpo.py, qat.py) reads and checks its data
first, so that a data problem costs nothing, then:

    run = start_run(cfg, backend, overwrite, echo, started)     output_dir claimed (locked; a run that
                                                                --overwrite replaces stays), seed, model
    ... the method's data, tokenized with run.handle.tokenizer
    run.take_output_dir()                                       the replaced run goes, the config copy comes
    run.measure_before(measure)                                 held-out numbers before training
    run.attach_adapter()                                        with its two lines of output
    trainer = run.create_trainer(); batcher = ...
    steps = run.restore(batcher)                                a resumed run's state back from its checkpoint
    stopped_early = train_loop(cfg, trainer, batcher, run.state, steps, run.checkpoint_writer(batcher), ...,
                               callbacks=run.callbacks())
    ... save what was trained
    result = run.result(stopped_early)
    result.after = run.measure_after(measure)
    return run.finish(result, n_train, n_val, **summary_fields)  merge, memory, seconds, run_summary.json

GPTQ trains nothing (no adapter, trainer or checkpoints) and keeps its own order: it loads the model
before it claims output_dir.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..evaluation.result import EvalResult
from ..monitor.memory import MemoryPhases
from . import outputs
from .loop import LoopState, checkpoint_writer, restore, resumed_step, total_steps_for
from .merge import merge_at_end
from .outputs import Claim, RunResult

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
    trainer: object = None
    memory: MemoryPhases | None = None          # peak device memory by phase, once the loop has callbacks

    @property
    def out(self) -> Path:
        return self.claim.out

    @property
    def resume_from(self) -> Path | None:
        return self.claim.resume_from

    def take_output_dir(self) -> Path:
        """Once the model and data have loaded: the run --overwrite replaces goes, the config copy comes."""
        return outputs.take_output_dir(self.cfg, self.claim, self.echo)

    def measure_before(self, measure: Measure | None) -> None:
        """Held-out numbers before training (eval.before_training, where there is held-out data: `measure`
        not None), kept in the loop state and so in every checkpoint: a resumed run has them already."""
        if self.cfg.eval.before_training and measure is not None and self.resume_from is None:
            before = measure()
            self.state.before = before.as_dict()
            self.echo(f"before training: {before.describe()}")

    def attach_adapter(self):
        self.info = self.backend.attach_adapter(self.handle, self.cfg.adapter)
        self.echo(f"model: {self.handle.describe()}")
        self.echo(f"adapter: {self.info.describe()}")
        return self.info

    def create_trainer(self):
        self.trainer = self.backend.create_trainer(self.handle, self.cfg.training)
        return self.trainer

    def restore(self, batcher) -> int:
        """The run's total optimizer steps; a resumed run first gets its weights, optimizer, data position
        and loop state back from the checkpoint it resumes."""
        steps = total_steps_for(self.cfg, batcher)
        if self.resume_from is not None:
            self.state = restore(self.cfg, self.backend, self.handle, self.trainer, batcher, self.resume_from)
            self.echo(f"resumed from {self.resume_from} (step {self.state.step} of {steps})")
        return steps

    def checkpoint_writer(self, batcher):
        return checkpoint_writer(self.cfg, self.backend, self.handle, self.trainer, batcher, self.out)

    def callbacks(self) -> list:
        """What the loop reports to: outputs.run_callbacks, and the peak memory of each phase
        (run_summary.json's `memory`, monitor/memory.py)."""
        self.memory = MemoryPhases(self.backend)
        return [*outputs.run_callbacks(self.cfg, self.out, self.echo), self.memory]

    def result(self, stopped_early: bool) -> RunResult:
        """What the loop did, with the numbers from before training (from the checkpoint when resumed). The
        trained weights are saved and the last checkpoint written: the trainer releases its optimizer state
        and gradients, so the evaluation and the merge after training have that memory."""
        if self.trainer is not None:
            self.trainer.release()
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
        summary = outputs.run_summary(self.cfg, result, self.info, n_train, n_val, **extra)
        outputs.write_summary(self.out, summary if self.memory is None else outputs.with_memory(summary, self.memory))
        return result


def start_run(cfg, backend, overwrite: bool, echo, started: float, head: str | None = None) -> Run:
    """Claim output_dir (locked; a run that --overwrite replaces stays until take_output_dir), seed, load
    the model (with a scalar `head` for reward models): after the recipe's data checks, before its
    tokenization."""
    claim = outputs.claim_output_dir(cfg, overwrite)
    backend.seed(cfg.training.seed)
    handle = backend.load_model(cfg.model, cfg.training.precision, head=head, adapter=cfg.adapter)
    return Run(cfg, backend, echo, claim, started, handle)
