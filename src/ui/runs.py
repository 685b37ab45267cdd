"""The runs under the UI's folder, read from the records every run leaves (output_dir/rundir.py,
run_summary.json, metrics.jsonl, the lock), never from the UI's own memory: a run started with
`mudpuppy run` in a terminal shows as one started from the page does.

    status     running   the run folder's lock names a live process
               finished  run_summary.json says so (a run writes it last)
               starting  the page started its process, which has not taken the folder's lock yet
               stopped   no summary, not running, a checkpoint to resume from (or the page's record of
                         its process says it ended on Ctrl-C / SIGINT)
               failed    no summary, not running, and nothing to resume from (or a non-zero exit other
                         than Ctrl-C's, in the page's record)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..output_dir import records, rundir
from ..output_dir.locks import pid_running
from ..training.checkpoints import newest_complete

UI_DIR = ".mudpuppy-ui"              # the page's own folder inside RUNS_DIR: job records, logs, form configs
MAX_DEPTH = 3                        # how deep under RUNS_DIR runs are looked for
SKIP = {UI_DIR, "checkpoints", ".git", "node_modules", "__pycache__", ".venv"}


class OutsideFolder(ValueError):
    """A path that leaves the UI's folder."""


def inside(root: Path, relative: str) -> Path:
    """`relative` (a name the page sent) as a path inside `root`, links resolved; OutsideFolder when it
    leaves it (../, an absolute path, a link pointing out)."""
    if not isinstance(relative, str) or "\x00" in relative or relative.startswith(("/", "\\")) or ":" in relative:
        raise OutsideFolder(f"{relative!r} is not a path inside the runs folder")
    base = Path(os.path.realpath(root))
    target = Path(os.path.realpath(base / relative))
    if target != base and base not in target.parents:
        raise OutsideFolder(f"{relative!r} leads outside the runs folder {base}")
    return target


def is_run(folder: Path) -> bool:
    return (folder / rundir.MARKER).is_file() or rundir.looks_like_old_run(folder)


def find_runs(root: Path) -> list[Path]:
    """Every run folder under `root` (root included), MAX_DEPTH levels deep at most; a run's own folders
    are not searched for further runs."""
    found, base = [], Path(os.path.realpath(root))

    def walk(folder: Path, depth: int) -> None:
        if is_run(folder):
            found.append(folder)
            return
        if depth >= MAX_DEPTH:
            return
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink())
        except OSError:
            return
        for child in children:
            if child.name not in SKIP:
                walk(child, depth + 1)

    walk(base, 0)
    return found


def lock_holder(folder: Path) -> int | None:
    """The pid training in `folder` now: the lock file's holder while that process lives (a lock released
    is emptied, a killed holder's pid is no longer running)."""
    try:
        info = json.loads((folder / rundir.LOCK).read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return None
    pid = info.get("pid") if isinstance(info, dict) else None
    return pid if isinstance(pid, int) and pid > 0 and pid_running(pid) else None


def read_metrics(folder: Path, start: int = 0) -> tuple[list[dict], int]:
    """The complete lines of metrics.jsonl from byte `start`: (records, the offset after the last complete
    line). A line still being written is left for the next read."""
    path = folder / "metrics.jsonl"
    try:
        with path.open("rb") as fh:
            fh.seek(start)
            data = fh.read()
    except OSError:
        return [], start
    end = data.rfind(b"\n") + 1
    rows = []
    for line in data[:end].splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows, start + end


def metrics_size(folder: Path) -> int:
    try:
        return (folder / "metrics.jsonl").stat().st_size
    except OSError:
        return 0


def read_config(folder: Path) -> dict:
    try:
        data = yaml.safe_load((folder / rundir.CONFIG).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass
class RunInfo:
    name: str                  # the folder, relative to RUNS_DIR
    status: str
    method: str | None
    model: str | None
    adapter: str | None
    backend: str | None
    device: str | None
    steps: int | None
    max_steps: int | None
    final_loss: float | None
    heldout: dict
    pid: int | None
    resumable: bool

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def describe(root: Path, folder: Path, job: dict | None = None) -> RunInfo:
    """One run as the runs list shows it; `job` is the page's record of the process it started there."""
    summary = records.read_json(folder / rundir.SUMMARY) or {}
    cfg = read_config(folder)
    rows, _ = read_metrics(folder)
    steps = [r["step"] for r in rows if isinstance(r.get("step"), int) and "loss" in r]
    losses = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))]
    pid = lock_holder(folder)
    resumable = newest_complete(folder) is not None
    if pid is not None:
        status = "running"
    elif job is not None and job.get("exit_code") is None and isinstance(job.get("pid"), int) \
            and pid_running(job["pid"]) and not summary:
        status = "starting"                   # the page's process, before it has taken the folder's lock
    elif summary.get("status"):
        status = str(summary["status"])
    elif job is not None and job.get("exit_code") is not None:
        status = "stopped" if job["exit_code"] in (130, 143) else "failed"
    else:
        status = "stopped" if resumable else "failed"
    heldout = summary.get("eval_after") if isinstance(summary.get("eval_after"), dict) else {}
    heldout = {k: v for k, v in heldout.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "samples"}
    if not heldout:
        evals = [r for r in rows if "eval_loss" in r]
        heldout = {k[5:]: v for k, v in evals[-1].items() if k.startswith("eval_")} if evals else {}
    training = cfg.get("training") if isinstance(cfg.get("training"), dict) else {}
    adapter = cfg.get("adapter") if isinstance(cfg.get("adapter"), dict) else {}
    model = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
    return RunInfo(
        name=relative_name(root, folder), status=status,
        method=summary.get("method") or cfg.get("method"),
        model=summary.get("base_model") or model.get("base_model"),
        adapter=summary.get("adapter") or adapter.get("type"),
        backend=(job or {}).get("backend") or cfg.get("backend"),
        device=(job or {}).get("device"),
        steps=summary.get("steps") if isinstance(summary.get("steps"), int) else (steps[-1] if steps else None),
        max_steps=training.get("max_steps") if isinstance(training.get("max_steps"), int) else None,
        final_loss=summary.get("final_loss") if summary.get("final_loss") is not None
        else (losses[-1] if losses else None),
        heldout=heldout, pid=pid, resumable=bool(resumable))


def relative_name(root: Path, folder: Path) -> str:
    rel = os.path.relpath(os.path.realpath(folder), os.path.realpath(root))
    return "." if rel == "." else rel.replace(os.sep, "/")


def find_configs(root: Path) -> list[str]:
    """YAML files under `root` a new run may start from (runs' own config.yaml included: rerun one to a new
    folder), relative to root."""
    base, found = Path(os.path.realpath(root)), []
    for dirpath, dirnames, filenames in os.walk(base):
        depth = len(Path(dirpath).relative_to(base).parts)
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP and depth < MAX_DEPTH)
        found += [relative_name(base, Path(dirpath) / f) for f in sorted(filenames) if f.endswith((".yaml", ".yml"))]
    return found
