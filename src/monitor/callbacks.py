"""What the training loop reports to: callbacks, each one observer of a run with hooks that do nothing by default.

The loop (training/loop.py) calls the hooks of the callbacks it was given, in
order, and knows nothing of what they do; metrics.jsonl (metrics.py), the
trackers of `logging.report_to` (trackers.py), the progress lines
(progress.py) and the --tui dashboard (live.py) are callbacks like any a
user passes to `run`, which hear the run after those:

    from mudpuppy import create_backend, load_config, run
    from mudpuppy.monitor.callbacks import Callback

    class Losses(Callback):
        def on_step_end(self, step, metrics):
            print(step, metrics["loss"])

    run(load_config("configs/quickstart.yaml"), create_backend("cpu"), callbacks=[Losses()])

Modelled on mlx-lm's `TrainingCallback`, with the hooks of a whole loop.
Per optimizer step the loop calls, in this order:

    on_samples(step, samples)   completions the step's batches were made from (GRPO), when there are any
    on_log(record)              when the step is logged (every logging.log_every steps and the last)
    on_step_end(step, metrics)  every step
    on_eval_end(step, metrics)  then on_log(record), every training.eval_steps steps, held-out numbers
    on_checkpoint(step, path)   after a checkpoint is written

`on_run_start(total, done)` comes before the first step (`done` > 0 when a run resumes) and
`on_run_end()` after the last, also when the loop ends in an error; the checkpoint of the last step, where
training.save_steps does not divide it, is written and heard after that. A record is a line of
metrics.jsonl: rounded numbers, `step` and `elapsed` (seconds since the loop started) included.
"""

from __future__ import annotations

from pathlib import Path


class Callback:
    """One observer of a training loop; override the hooks it needs."""

    def on_run_start(self, total: int, done: int) -> None:
        """Training starts, or resumes after step `done`; `total` optimizer steps in all."""

    def on_samples(self, step: int, samples: list[dict]) -> None:
        """A few completions sampled for step `step`: {prompt, completion, reward}."""

    def on_log(self, record: dict) -> None:
        """A line of the run's record, as metrics.jsonl holds it."""

    def on_step_end(self, step: int, metrics: dict) -> None:
        """Step `step` (1-based) is done: loss, lr, tokens, tokens_per_second, grad_norm, skipped, epoch and
        the method's own numbers, unrounded."""

    def on_eval_end(self, step: int, metrics: dict) -> None:
        """Held-out data was measured after step `step` (eval_loss and the method's eval_* numbers)."""

    def on_checkpoint(self, step: int, path: Path) -> None:
        """The checkpoint of step `step` is complete at `path`."""

    def on_run_end(self) -> None:
        """The loop is over: finished, stopped early, interrupted or failed."""


class Callbacks(Callback):
    """A list of callbacks called in order: what the loop holds."""

    def __init__(self, callbacks: list[Callback]):
        self.callbacks = list(callbacks)

    def on_run_start(self, total: int, done: int) -> None:
        for cb in self.callbacks:
            cb.on_run_start(total, done)

    def on_samples(self, step: int, samples: list[dict]) -> None:
        for cb in self.callbacks:
            cb.on_samples(step, samples)

    def on_log(self, record: dict) -> None:
        for cb in self.callbacks:
            cb.on_log(dict(record))         # each its own copy: one that edits it changes nothing for the next

    def on_step_end(self, step: int, metrics: dict) -> None:
        for cb in self.callbacks:
            cb.on_step_end(step, dict(metrics))

    def on_eval_end(self, step: int, metrics: dict) -> None:
        for cb in self.callbacks:
            cb.on_eval_end(step, dict(metrics))

    def on_checkpoint(self, step: int, path: Path) -> None:
        for cb in self.callbacks:
            cb.on_checkpoint(step, path)

    def on_run_end(self) -> None:
        """Every callback's end, even after one of them failed; the first failure is raised after."""
        failed = None
        for cb in self.callbacks:
            try:
                cb.on_run_end()
            except Exception as exc:     # noqa: BLE001 - the others still close their files
                failed = failed or exc
        if failed is not None:
            raise failed
