"""What a run returns, reports while it trains and writes at its end.

While it trains, the loop reports to `run_callbacks` (metrics.jsonl, the trackers, the progress display:
monitor/); at the end every recipe returns a `RunResult` and writes `run_summary` with write_summary,
the last file of the run, which releases the run folder's lock. The folder itself (claiming it, what
--overwrite may remove, its marker and lock) is mudpuppy.output_dir's.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..evaluation.result import EvalResult
from ..files import write_json_atomic
from ..monitor.metrics import METRICS, MetricsFile
from ..output_dir import rundir
from ..output_dir.rundir import SUMMARY

@dataclass
class RunResult:
    output_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    before: EvalResult | None = None      # held-out numbers before training (every method: evaluation/result.py)
    after: EvalResult | None = None
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    skipped_steps: int = 0
    stopped_early: bool = False
    resumed_from: int | None = None
    model: object = None          # the trained ModelHandle, for generation or further use in Python


def write_summary(out: Path, ranks, data) -> None:
    """The charts and model card (monitor/report.py), then run_summary.json, the last thing a run writes; by
    rank 0 of a distributed run. A chart or card that fails to write costs the run nothing but that file."""
    from ..monitor.report import write_run_report
    from ..monitor.trackers import close_trackers

    if ranks.is_main:
        try:
            rundir.record(out, write_run_report(out, data))
        except Exception as exc:      # noqa: BLE001 - the trained weights are saved; never fail the run here
            print(f"run report (charts, README.md) not written: {type(exc).__name__}: {exc}", file=sys.stderr)
        close_trackers(out, data)
        rundir.record(out, [SUMMARY])
        write_json_atomic(out / SUMMARY, data)
        rundir.end_run(out)             # the run has written its last file: another may use the directory


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
        "eval_before": result.before.as_dict() if result.before is not None else None,
        "eval_after": result.after.as_dict() if result.after is not None else None,
    }


def run_callbacks(cfg, out: Path, echo, ranks) -> list:
    """What a training loop reports to unless its recipe says otherwise: metrics.jsonl, the trackers of
    logging.report_to (started with the run's first loop, open until write_summary) and the progress display,
    the --tui dashboard when one draws for `echo`; rank 0 alone, the other ranks of a distributed run report
    nothing."""
    from ..monitor.live import progress_display
    from ..monitor.trackers import open_trackers

    if not ranks.is_main:
        return []
    rundir.record(out, tracker_dirs(cfg.logging.report_to))
    trackers = open_trackers(cfg, out)
    return [MetricsFile(out, written=lambda where: rundir.record(where, [METRICS])),
            *([trackers] if trackers is not None else []),
            progress_display(cfg.logging, echo)]


def tracker_dirs(report_to) -> list[str]:
    """The folders the trackers of `logging.report_to` write in output_dir (monitor/trackers.py)."""
    dirs = {"tensorboard": "tensorboard", "wandb": "wandb"}
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        dirs["mlflow"] = "mlruns"
    return [dirs[kind] for kind in report_to or [] if kind in dirs]
