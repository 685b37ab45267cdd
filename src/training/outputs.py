"""The run's output directory: never overwrite a user's finished work by accident."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import yaml

from ..errors import OutputExists

SUMMARY = "run_summary.json"
METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
OURS = (SUMMARY, METRICS, CONFIG)


def prepare_output_dir(path: str | Path, overwrite: bool, resume: bool | str = False) -> tuple[Path, Path | None]:
    """Make the output directory ready; returns it and the checkpoint to resume from, if any.

    A non-empty directory is refused unless the run resumes from it or
    --overwrite is given, and --overwrite never clears a directory that does
    not look like one of our runs.
    """
    from .checkpoints import newest_checkpoint, remove_stale_staging

    out = Path(path)
    if out.exists() and not out.is_dir():
        raise OutputExists(f"output_dir {out} is a file, not a directory")
    finished = (out / SUMMARY).exists()
    if resume and not overwrite:
        ckpt = newest_checkpoint(out) if out.is_dir() else None
        if finished:
            raise OutputExists(f"output_dir {out} holds a finished run; nothing to resume "
                               "(pass --overwrite to train again from scratch)")
        if ckpt is not None:
            remove_stale_staging(out)
            return out, ckpt
        if resume is True:
            raise OutputExists(f"--resume: no complete checkpoint in {out}/checkpoints "
                               "(set training.save_steps to write them)")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            what = "a finished run" if finished else "files"
            hint = "" if finished else ", --resume to continue from its newest checkpoint,"
            raise OutputExists(
                f"output_dir {out} already holds {what}; choose another output_dir "
                f"(e.g. --set output_dir=...){hint} or pass --overwrite to replace it")
        if not any((out / name).exists() for name in OURS):
            raise OutputExists(
                f"output_dir {out} is not empty and does not look like a mudpuppy run "
                f"(no {SUMMARY}, {METRICS} or {CONFIG}); refusing to clear it even with --overwrite")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out, None


def start_output_dir(cfg, overwrite: bool) -> tuple[Path, Path | None]:
    """prepare_output_dir and the config copy; in a distributed run rank 0 does both and every rank gets
    its answer (or its error), so no two processes clear or write the same directory."""
    from ..distributed import current
    from .trackers import check_available

    check_available(list(cfg.logging.report_to))          # a missing tracker stops the run before it starts

    def prepare():
        out, resume_from = prepare_output_dir(cfg.output_dir, overwrite, cfg.resume)
        write_config(out, cfg)
        return out, resume_from

    return current().on_main(prepare)


def write_summary(out: Path, data) -> None:
    """The charts and model card (report.py), then run_summary.json, the last thing a run writes; by rank 0
    of a distributed run. A chart or card that fails to write costs the run nothing but that file."""
    from ..distributed import current
    from .report import write_run_report
    from .trackers import close_trackers

    if current().is_main:
        try:
            write_run_report(out, data)
        except Exception as exc:      # noqa: BLE001 - the trained weights are saved; never fail the run here
            print(f"run report (charts, README.md) not written: {type(exc).__name__}: {exc}", file=sys.stderr)
        close_trackers(out, data)
        write_json_atomic(out / SUMMARY, data)


def write_json_atomic(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_config(out: Path, cfg) -> None:
    (out / CONFIG).write_text(yaml.safe_dump(cfg.dump(), sort_keys=False), encoding="utf-8")


class NoLog:
    """The metrics log of a rank other than 0 in a distributed run: rank 0 writes the run's log."""

    def write(self, **fields) -> None:
        pass

    def close(self) -> None:
        pass


class MetricsLog:
    """One JSON object per line, flushed each time, so a crash keeps everything logged.

    On resume, lines logged after the checkpoint's step (by the run that died)
    are dropped first, so the file reads as one uninterrupted run.
    """

    def __init__(self, out: Path, truncate_after: int | None = None, trackers=None):
        self.trackers = trackers         # trackers.Trackers: each line also goes to logging.report_to
        self.path = out / METRICS
        self.start = time.perf_counter()
        if truncate_after is not None and self.path.exists():
            kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= truncate_after]
            self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        self.fh = self.path.open("a", encoding="utf-8")

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def write(self, **fields) -> None:
        fields.setdefault("elapsed", round(self.elapsed(), 3))
        self.fh.write(json.dumps(fields) + "\n")
        self.fh.flush()
        if self.trackers is not None:
            self.trackers.log(fields)

    def close(self) -> None:
        self.fh.close()
