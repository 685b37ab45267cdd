"""The run's output directory: never overwrite a user's finished work by accident; what a run writes there.

A run claims its directory before any model loads (claim_output_dir: lock, then decide: new, resume,
or replace) and takes it once the model and data have loaded (take_output_dir: the replaced run's
files go, the config copy comes). The marker and the lock live in rundir.py. While it trains, the
loop reports to `run_callbacks` (metrics.jsonl, the trackers, the progress display: monitor/); at
the end every recipe returns a `RunResult` and writes `run_summary` with write_summary. The recipes call
these through session.py (start_run, Run.finish).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import MudpuppyError, OutputExists
from ..evaluation.result import EvalResult
from ..files import write_json_atomic
from ..monitor.metrics import METRICS, MetricsFile, MetricsLog
from . import rundir

SUMMARY = "run_summary.json"
CONFIG = "config.yaml"

__all__ = ["CONFIG", "METRICS", "SUMMARY", "Claim", "MetricsLog", "RunResult", "claim_output_dir", "claim_dir",
           "run_callbacks", "run_summary", "start_output_dir", "take_output_dir", "write_config", "write_summary"]


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


@dataclass
class Claim:
    """An output directory this process holds the lock of, and what the run will do there."""

    out: Path
    resume_from: Path | None = None      # the checkpoint to resume from
    replacing: bool = False              # --overwrite: the old run goes in take_output_dir, not before


def claim_output_dir(cfg, overwrite: bool) -> Claim:
    """Lock the run's directory and decide what happens to it, before any model loads; nothing is removed
    here. In a distributed run rank 0 decides (and holds the lock) and every rank gets its answer, or its
    error, so no two processes clear or write the same directory."""
    from ..distributed import current
    from ..monitor.trackers import check_available

    check_available(list(cfg.logging.report_to))          # a missing tracker stops the run before it starts
    return current().on_main(lambda: claim_dir(cfg.output_dir, overwrite, cfg.resume, cfg))


def take_output_dir(cfg, claim: Claim, echo=print) -> Path:
    """Once the model and data have loaded: the run replaced by --overwrite goes (only what it wrote), then
    the config copy. A typo in the model name, a bad data file, fail before this and cost nothing."""
    from ..distributed import current

    current().on_main(lambda: _take(cfg, claim, echo))
    return claim.out


def start_output_dir(cfg, overwrite: bool, echo=print) -> tuple[Path, Path | None]:
    """claim_output_dir and take_output_dir at once: for a method that has loaded its model and data already."""
    claim = claim_output_dir(cfg, overwrite)
    take_output_dir(cfg, claim, echo)
    return claim.out, claim.resume_from


def claim_dir(path: str | Path, overwrite: bool, resume: bool | str = False, cfg=None) -> Claim:
    """The decisions of claim_output_dir, in this process.

    A directory is written to only when it is empty, new, or marked as a mudpuppy run (rundir.MARKER); a
    run from before markers may be resumed (it is adopted), never replaced. The lock is taken before
    anything that could remove a file is decided, and the state is read again under it.
    """
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise OutputExists(f"output_dir {out} is a file, not a directory")
    if overwrite:
        rundir.check_overwrite_target(out, cfg)
    _refuse_foreign(out, overwrite)
    if resume is True and not overwrite and not out.is_dir():
        raise OutputExists(f"--resume: no complete checkpoint in {out}/checkpoints ({out} does not exist)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputExists(f"output_dir {out}: cannot create it ({exc.strerror})") from None
    rundir.start_run(out)
    try:
        claim = _decide(out, overwrite, resume)
    except MudpuppyError:
        rundir.end_run(out)
        raise
    if rundir.read_marker(out) is None:       # a new run, or one from before markers resumed: adopted for the
        ours, theirs = rundir.adopt(out)      # run layout's names alone (the user's notes are never claimed)
        rundir.write_marker(out, written=ours, foreign=theirs)
    return claim


def _refuse_foreign(out: Path, overwrite: bool) -> None:
    """A non-empty directory without the marker: nothing mudpuppy may write into (or clear)."""
    if not rundir.entries(out) or rundir.read_marker(out) is not None:
        return
    if rundir.looks_like_old_run(out):
        if overwrite:
            raise OutputExists(
                f"--overwrite: output_dir {out} holds a run made before mudpuppy marked its runs (no "
                f"{rundir.MARKER}), so mudpuppy cannot tell the run's files from yours and will not replace it; "
                f"delete it yourself (rm -r {out}) if you no longer need it, or choose another output_dir")
        return                   # --resume adopts it; without either flag _decide says what to do
    refusing = "refusing to clear it even with --overwrite; " if overwrite else ""
    raise OutputExists(f"output_dir {out} is not empty and does not look like a mudpuppy run (no {rundir.MARKER}); "
                       f"{refusing}choose another output_dir (e.g. --set output_dir=...)")


def _decide(out: Path, overwrite: bool, resume: bool | str) -> Claim:
    from .checkpoints import newest_checkpoint, remove_stale_staging

    finished = (out / SUMMARY).exists()
    if resume and not overwrite:
        ckpt = newest_checkpoint(out)
        if finished:
            raise OutputExists(f"output_dir {out} holds a finished run; nothing to resume "
                               "(pass --overwrite to train again from scratch)")
        if ckpt is not None:
            remove_stale_staging(out)
            return Claim(out, ckpt)
        if resume is True:
            raise OutputExists(f"--resume: no complete checkpoint in {out}/checkpoints "
                               "(set training.save_steps to write them)")
    ours, foreign = rundir.split_entries(out, rundir.read_marker(out))
    if ours and not overwrite:
        what = "a finished run" if finished else "files"
        hint = "" if finished else ", --resume to continue from its newest checkpoint,"
        raise OutputExists(
            f"output_dir {out} already holds {what}; choose another output_dir "
            f"(e.g. --set output_dir=...){hint} or pass --overwrite to replace it")
    return Claim(out, replacing=bool(ours or foreign))


def _take(cfg, claim: Claim, echo) -> None:
    out = claim.out
    if claim.replacing:
        ours, kept = rundir.split_entries(out, rundir.read_marker(out))
        stayed = rundir.remove_entries(out, ours)
        if ours:
            echo(f"--overwrite: removed the previous run from {out} ({_names(ours)})")
        if stayed:
            echo(f"--overwrite: kept what the previous run's outputs held that it did not write: {_names(stayed)}")
            kept = sorted(set(kept) | {name.split('/')[0] for name in stayed})
        if kept:
            echo(f"--overwrite: kept {len(kept)} entr{'y' if len(kept) == 1 else 'ies'} the previous run did "
                 f"not write: {_names(kept)}")
        rundir.write_marker(out, foreign=kept)
    write_config(out, cfg)


def _names(names: list[str], shown: int = 8) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def write_summary(out: Path, data) -> None:
    """The charts and model card (monitor/report.py), then run_summary.json, the last thing a run writes; by
    rank 0 of a distributed run. A chart or card that fails to write costs the run nothing but that file."""
    from ..distributed import current
    from ..monitor.report import write_run_report
    from ..monitor.trackers import close_trackers

    if current().is_main:
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


def with_memory(summary: dict, memory) -> dict:
    """The summary with the run's peak device memory per phase (monitor/memory.py), where the backend has it."""
    if memory.phases:
        summary["memory"] = memory.phases
    return summary


def run_callbacks(cfg, out: Path, echo) -> list:
    """What a training loop reports to unless its recipe says otherwise: metrics.jsonl, the trackers of
    logging.report_to (started with the run's first loop, open until write_summary) and the progress display,
    the --tui dashboard when one draws for `echo`; rank 0 alone, the other ranks of a distributed run report
    nothing."""
    from ..distributed import current
    from ..monitor.live import progress_display
    from ..monitor.trackers import open_trackers

    if not current().is_main:
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


def write_config(out: Path, cfg) -> None:
    rundir.record(out, [CONFIG])
    (out / CONFIG).write_text(yaml.safe_dump(cfg.dump(), sort_keys=False), encoding="utf-8")
