"""The run directory mudpuppy owns: a marker listing what it wrote there, and a lock while a run uses it.

    .mudpuppy-run.json   written when a run claims the directory, before anything else: format, who made
                         it and when, `written` (the top-level names the run wrote, each recorded by the
                         code that writes it, before it writes it) and `foreign` (names that were there
                         already and are not the run's)
    .mudpuppy-run.lock   flock'ed for as long as a process trains there; holds that process's pid and
                         command. The kernel drops the lock when the process ends, however it ends
                         (SIGKILL included), so a stale file never blocks anyone.

A run directory is written as the run goes (checkpoints, metrics, then its final save), so unlike the
other verbs' outputs (staging.py) it is not built beside and renamed; what it saves at the end is
(publish_staged). The run never lists its directory to learn what it wrote: a file the user puts there,
or another verb's output (`export --out RUN/gguf`), is never claimed. A run from before markers is adopted
only for the names of the run's own layout (LAYOUT). `--overwrite` removes only the names the marker lists
(and the few every run writes), never the directory itself, never a directory without the marker: see
claim.py.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import OutputExists
from ..files import move_into, write_json_atomic
from . import locks, records

CONFIG = "config.yaml"                   # the run's config, as it ran
SUMMARY = "run_summary.json"             # written last: its presence means the run finished
MARKER = ".mudpuppy-run.json"
LOCK = ".mudpuppy-run.lock"
FORMAT = 1
OWN = frozenset({MARKER, LOCK})          # never listed, never removed: they say whose directory it is
# Names every run writes, the run's even when a killed run had no time to record them.
STAGING_FINAL = ".saving-final"          # where the final save writes first (loop.staged_final)
ALWAYS = frozenset({CONFIG, "metrics.jsonl", SUMMARY, "checkpoints", "completions.jsonl",
                    "heldout-eval", STAGING_FINAL})
# The run's layout: every top-level name a run of some method writes (its final save's model files aside,
# records.MODEL_FILES and ADAPTER_FILES). What a run from before markers is adopted for, and nothing else.
LAYOUT = ALWAYS | {"README.md", "loss.png", "reward.png", "margins.png", "accuracy.png", "tensorboard", "mlruns",
                   "wandb", "merged", "trained", "adapter", "mlx", "ptq_baseline.json", "qat-branch-point"}


class RunDirInUse(OutputExists):
    """Another process trains in this directory."""


# --------------------------------------------------------------------------- the marker
def read_marker(out: Path) -> dict | None:
    return records.read_json(Path(out) / MARKER)


def write_marker(out: Path, written=(), foreign=()) -> dict:
    """A fresh marker: this process claims `out` (a new run, or the one replacing an old run)."""
    from .. import __version__

    marker = {"format": FORMAT, "created_by": f"mudpuppy {__version__}", "command": locks.command(),
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "created_at": time.time(),
              "written": sorted(written), "foreign": sorted(foreign)}
    _store(out, marker)
    _listed[_key(out)] = set(marker["written"])
    return marker


def record(out: Path, names) -> None:
    """Add `names` (top-level entries the run is about to write) to the marker's `written`; a name the run
    now writes is no longer foreign. Cheap when they are listed already: no file is read. Rank 0 of a
    distributed run alone calls it: the marker has one writer."""
    key, names = _key(out), set(names)
    if key not in _listed:
        marker = read_marker(out)
        if marker is None:
            return                  # not a marked directory (a run called on a bare folder from Python)
        _listed[key] = set(marker.get("written", []))
    if names <= _listed[key]:
        return
    marker = read_marker(out) or {}
    marker["written"] = sorted(set(marker.get("written", [])) | names)
    marker["foreign"] = sorted(set(marker.get("foreign", [])) - names)
    _store(out, marker)
    _listed[key] |= names


def publish_staged(stage: Path, out: Path) -> list[str]:
    """What a save wrote in `stage` (the run's own staging folder: only this process writes there) recorded,
    then renamed into `out`."""
    names = sorted(os.listdir(stage))
    if "README.md" in names and is_theirs(out, "README.md"):   # PEFT's placeholder card over the user's file:
        os.remove(stage / "README.md")                          # dropped; the run's card goes beside it
        names.remove("README.md")                               # (monitor/report.py)
    record(out, names)
    move_into(stage, out)
    return names


def is_theirs(out: Path, name: str) -> bool:
    """`name` is in the marked run directory `out` and the run did not write it (its marker does not list
    it): the user's file, or another verb's; the run must not write over it."""
    path = Path(out) / name
    if not (path.exists() or path.is_symlink()):
        return False
    marker = read_marker(out)
    return marker is not None and name not in set(marker.get("written", [])) | ALWAYS


def adopt(out: Path) -> tuple[list[str], list[str]]:
    """(the run's names, everyone else's) in a directory written before markers: the run's layout only."""
    patterns = (*LAYOUT, *records.MODEL_FILES, *records.ADAPTER_FILES)
    present = entries(out)
    ours = [n for n in present if records.matches(n, patterns)]
    return ours, [n for n in present if n not in ours]


def split_entries(out: Path, marker: dict | None) -> tuple[list[str], list[str]]:
    """(the run's entries, everyone else's) among what `out` holds now, the marker and lock aside."""
    marker = marker or {}
    ours = (set(marker.get("written", [])) | ALWAYS) - set(marker.get("foreign", []))
    present = entries(out)
    return [n for n in present if n in ours], [n for n in present if n not in ours]


def remove_entries(out: Path, names: list[str]) -> list[str]:
    """The run's `names` removed; an output folder inside the run (its merged model, its held-out report)
    loses only its own files. Returns what stayed because it holds files the run did not write."""
    stayed = []
    for name in names:
        path = Path(out) / name
        if path.is_dir() and not path.is_symlink() and records.holds_output(path):
            stayed += [f"{name}/{n}" for n in records.remove_output(path)]
        else:
            records.remove_names(out, [name])
    _listed.pop(_key(out), None)
    return stayed


def entries(out: Path) -> list[str]:
    """What `out` holds, sorted, the marker and the lock aside ([] for a directory that does not exist)."""
    return [name for name in records.entries(out) if name not in OWN]


def looks_like_old_run(out: Path) -> bool:
    """A run written before markers existed: its config copy and its log or summary."""
    return (out / CONFIG).is_file() and ((out / "metrics.jsonl").is_file() or (out / SUMMARY).is_file())


_listed: dict[str, set[str]] = {}        # directory -> the names its marker lists now (saves re-reading it)


def _store(out: Path, marker: dict) -> None:
    write_json_atomic(Path(out) / MARKER, marker)


# --------------------------------------------------------------------------- the lock
_held: dict[str, list] = {}              # directory -> [lock file descriptor or None, holds by this process]
_runs: set[str] = set()                  # directories a run of this process claimed (see end_run)


def lock(out: Path) -> None:
    """Hold `out`'s lock, or raise RunDirInUse naming the process that holds it. The same process may
    take it again (a curriculum and its stages, a run called twice from Python): holds are counted."""
    key = _key(out)
    if key in _held:
        _held[key][1] += 1
        return
    fd = locks.acquire_lock(Path(key) / LOCK, f"output_dir {out}", "output_dir", RunDirInUse)
    _held[key] = [fd, 1]


def unlock(out: Path) -> None:
    key = _key(out)
    if key not in _held:
        return
    _held[key][1] -= 1
    if _held[key][1] <= 0:
        locks.release_lock(_held.pop(key)[0])     # the file stays: it lives inside the run directory


@contextmanager
def locked(out: Path):
    lock(out)
    try:
        yield
    finally:
        unlock(out)


def start_run(out: Path) -> None:
    """The lock a run claims with its directory, held until end_run (or the process ends)."""
    key = _key(out)
    if key not in _runs:
        lock(out)
        _runs.add(key)
    _listed.pop(key, None)              # read the marker afresh: another process may have run here since


def end_run(out: Path) -> None:
    """Drop the hold start_run took (once, however often it is called): after the summary, or when a
    run called from Python failed."""
    key = _key(out)
    if key in _runs:
        _runs.discard(key)
        unlock(out)


def _key(out: Path) -> str:
    return os.path.realpath(os.path.expanduser(out))
