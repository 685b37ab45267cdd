"""Checkpoints that are either complete or invisible, and exact resume from them.

A checkpoint is written into a hidden temporary directory and renamed into
place only after its marker file is written, so a crash (or SIGKILL) mid-save
never leaves a directory that looks complete. `newest_checkpoint` only ever
returns directories with the marker.

Layout of ``output_dir/checkpoints/step-00000010/``:

    weights + optimizer + runtime RNG   written by the backend (save_training_state)
    pipeline_state.json                 step, data position, schedule, eval history
    complete.json                       written last; its presence means "complete"

In a distributed run every rank writes its part of the weights and optimizer
into the same staging directory; rank 0 alone creates it, writes the two JSON
files and renames it once all ranks are done, so a crash of any rank leaves
the previous checkpoint as the newest complete one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..distributed import current as current_ranks
from ..errors import MudpuppyError

DIRNAME = "checkpoints"
MARKER = "complete.json"
STATE = "pipeline_state.json"


def checkpoint_root(output_dir: Path) -> Path:
    return Path(output_dir) / DIRNAME


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def newest_checkpoint(output_dir: Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def save_checkpoint(output_dir: Path, step: int, identity: dict, pipeline_state: dict,
                    write_backend_state, keep_last_n: int | None) -> Path:
    """Write one checkpoint atomically; `write_backend_state(dir)` saves weights and optimizer
    (collectively, in a distributed run: every rank calls this)."""
    ranks = current_ranks()
    root = checkpoint_root(output_dir)
    final = root / f"step-{step:08d}"
    # One staging directory for all ranks of a distributed run (rank 0's pid names it).
    staging = root / f".tmp-step-{step:08d}-{ranks.broadcast(os.getpid())}"
    if ranks.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
    ranks.barrier()
    write_backend_state(staging)
    ranks.barrier()
    if ranks.is_main:
        _finish(output_dir, root, staging, final, step, identity, pipeline_state, keep_last_n)
    ranks.barrier()
    return final


def _finish(output_dir, root: Path, staging: Path, final: Path, step: int, identity: dict, pipeline_state: dict,
            keep_last_n: int | None) -> None:
    (staging / STATE).write_text(json.dumps(pipeline_state), encoding="utf-8")
    (staging / MARKER).write_text(json.dumps({"step": step, **identity}), encoding="utf-8")
    _fsync_dir(staging)
    if final.exists():            # a checkpoint of this step from an earlier attempt
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(root)
    if keep_last_n:
        for old in list_checkpoints(output_dir)[:-keep_last_n]:
            shutil.rmtree(old, ignore_errors=True)


def read_checkpoint(path: Path, identity: dict) -> dict:
    """The pipeline state of a checkpoint, after checking it belongs to this run."""
    marker = json.loads((path / MARKER).read_text(encoding="utf-8"))
    for key, want in identity.items():
        have = marker.get(key)
        if have != want:
            raise MudpuppyError(
                f"cannot resume from {path}: it was made with {key}={have!r}, this config has {key}={want!r}; "
                "use the original config, or a new output_dir to start over")
    return json.loads((path / STATE).read_text(encoding="utf-8"))


def remove_stale_staging(output_dir: Path) -> None:
    """Half-written checkpoints from a killed process: never complete, safe to delete."""
    root = checkpoint_root(output_dir)
    if root.is_dir():
        for p in root.glob(".tmp-step-*"):
            shutil.rmtree(p, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
