"""The run's output directory: never overwrite a user's finished work by accident."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import yaml

from ..errors import OutputExists

SUMMARY = "run_summary.json"
METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
OURS = (SUMMARY, METRICS, CONFIG)


def prepare_output_dir(path: str | Path, overwrite: bool) -> Path:
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise OutputExists(f"output_dir {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()):
        finished = (out / SUMMARY).exists()
        if not overwrite:
            what = "a finished run" if finished else "files"
            raise OutputExists(
                f"output_dir {out} already holds {what}; choose another output_dir "
                "(e.g. --set output_dir=...) or pass --overwrite to replace it")
        if not any((out / name).exists() for name in OURS):
            raise OutputExists(
                f"output_dir {out} is not empty and does not look like a mudpuppy run "
                f"(no {SUMMARY}, {METRICS} or {CONFIG}); refusing to clear it even with --overwrite")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_json_atomic(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_config(out: Path, cfg) -> None:
    (out / CONFIG).write_text(yaml.safe_dump(cfg.dump(), sort_keys=False), encoding="utf-8")


class MetricsLog:
    """One JSON object per line, flushed each time, so a crash keeps everything logged."""

    def __init__(self, out: Path):
        self.path = out / METRICS
        self.start = time.perf_counter()
        self.fh = self.path.open("a", encoding="utf-8")

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def write(self, **fields) -> None:
        fields.setdefault("elapsed", round(self.elapsed(), 3))
        self.fh.write(json.dumps(fields) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()
