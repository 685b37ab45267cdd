"""Checkpoints that are either complete or invisible, and exact resume from them.

A checkpoint is written into a hidden temporary directory and renamed into
place only after its marker file is written, so a crash (or SIGKILL) mid-save
never leaves a directory that looks complete. `newest_checkpoint` only ever
returns directories with the marker.

Layout of ``output_dir/checkpoints/step-00000010/``:

    weights + optimizer + runtime RNG   written by the backend (save_training_state)
    portable_state.{json,safetensors}   the same weights and optimizer state, runtime-neutral, and which
                                        backend wrote them: another runtime resumes from these
                                        (backends/portable_state.py, docs/backends.md)
    pipeline_state.json                 step, data position, schedule, eval history
    complete.json                       written last; its presence means "complete"; lists every
                                        file of the checkpoint with its size and its sha256, and
                                        what the run was trained with (resume_changes.py)

In a distributed run every rank writes its part of the weights and optimizer
into the same staging directory; rank 0 alone creates it, writes the two JSON
files and renames it once all ranks are done, so a crash of any rank leaves
the previous checkpoint as the newest complete one.

A checkpoint that is complete can still be damaged later (a disk that
filled while another program wrote, a copy cut short, bytes changed in
place): `newest_checkpoint` checks the files of each before offering it
(sizes and sha256 against the marker's lists, safetensors headers, JSON,
torch files' structure, DCP metadata through an allow-list; files.py) and
falls back to the next older one that reads, saying which it skipped and
why. Checkpoints written before the marker held digests get every check but
the digest. A checkpoint whose damage shows only while it loads is reported
with `skip_unloadable` and the resume goes on from `older_checkpoint`
(session.py). A damaged checkpoint is never deleted: when the resumed run
writes that step again, the damaged one is moved aside to
``checkpoints/.damaged-step-N-<time>``.
A write that fails (a full disk) removes its staging directory and ends in
one message; the checkpoints before it stay.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from .. import files
from ..errors import MudpuppyError

DIRNAME = "checkpoints"
MARKER = "complete.json"
STATE = "pipeline_state.json"
SHARDED = "sharded"         # a distributed run's DCP files (backends/torch/distributed.py)
PLAIN = "trainable.safetensors"     # a single process's weights (both backends' state.py)
DIGESTS = "digests"         # complete.json's key: each file's sha256 when it was written


def checkpoint_root(output_dir: Path) -> Path:
    return Path(output_dir) / DIRNAME


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def newest_complete(output_dir: Path) -> Path | None:
    """The newest checkpoint with its marker, unchecked: for messages right after this process wrote it."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def newest_checkpoint(output_dir: Path, report=None) -> Path | None:
    """The newest complete checkpoint whose files read; each newer damaged one is skipped with one line to
    `report` (stderr by default). None when there is no complete checkpoint; an error listing them when
    none reads."""
    return _first_readable(list_checkpoints(output_dir), output_dir, report)


def older_checkpoint(output_dir: Path, than: Path, report=None) -> Path | None:
    """The newest complete checkpoint older than `than` whose files read (None when there is none), each
    damaged one between them skipped with one line: where a resume goes on when `than` did not load."""
    older = [p for p in list_checkpoints(output_dir) if step_of(p) < step_of(than)]
    try:
        return _first_readable(older, output_dir, report)
    except files.CorruptFile:
        return None


def _first_readable(found: list[Path], output_dir: Path, report) -> Path | None:
    skipped = []
    for path in reversed(found):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        skipped.append(f"{path.name} ({problem})")
        if path not in _reported:
            _reported.add(path)
            (report or _to_stderr)(f"warning: skipping checkpoint {path}: {problem}; it is kept (never read), "
                                   "the next older one is tried")
    if skipped:
        raise files.CorruptFile(f"no checkpoint in {checkpoint_root(output_dir)} reads: {'; '.join(skipped)}. "
                                "They are kept as they are; start over with --overwrite or a new output_dir")
    return None


def skip_unloadable(path: Path, exc: BaseException, report=None) -> str:
    """A checkpoint that passed the checks but failed while it loaded: damage the checks cannot see (one
    written before the marker held digests). One line says so; from now on this process treats it as
    damaged: never offered again, and moved aside rather than deleted when its step is written again."""
    reason = f"it did not load ({type(exc).__name__}: {_first_line(exc)})"
    _unloadable[Path(path)] = reason
    _reported.add(Path(path))
    (report or _to_stderr)(f"warning: skipping checkpoint {path}: {reason}; it is kept, the next older one is tried")
    return reason


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else "no message"


def step_of(path: Path) -> int:
    return int(Path(path).name.split("-")[1])


_reported: set[Path] = set()        # each damaged checkpoint is reported once per process
_unloadable: dict[Path, str] = {}   # checkpoints that failed while loading in this process, and why
_verified: dict[Path, tuple] = {}   # checkpoints whose digests matched, by the state of their files then


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from (its files damaged), or None. Plain reads only:
    sizes and digests against the marker's lists, then each file's structure (files.py); nothing is
    unpickled."""
    if Path(path) in _unloadable:
        return _unloadable[Path(path)]
    try:
        marker = files.read_json(path / MARKER)
        if not isinstance(marker, dict):
            raise files.CorruptFile(f"{path / MARKER}: not a JSON object")
        files.read_json(path / STATE)
        listed = marker.get("files") or {}
        if not isinstance(listed, dict):
            raise files.CorruptFile(f"{path / MARKER}: its file list is not a JSON object")
        for name, size in listed.items():
            have = (path / name).stat().st_size if (path / name).is_file() else None
            if have != size:
                what = "missing" if have is None else f"{have:,} bytes, written as {size:,}"
                raise files.CorruptFile(f"{path / name}: {what}")
        _check_digests(path, marker.get(DIGESTS))
        files.check_directory(path, everything=True)
        if (path / SHARDED).exists():
            if (path / PLAIN).exists():
                raise files.CorruptFile(both_kinds(path))
            files.check_dcp_dir(path / SHARDED)
    except files.CorruptFile as exc:
        return str(exc).removeprefix(f"{path}/")
    except OSError as exc:
        return f"cannot be read ({exc})"
    return None


def _check_digests(path: Path, digests) -> None:
    """Each file's sha256 against the one recorded when it was written: damage that keeps the size (bytes
    changed in place, a bad sector, a copy that went wrong) shows here. Absent in older checkpoints."""
    if digests is None:
        return
    if not isinstance(digests, dict):
        raise files.CorruptFile(f"{path / MARKER}: its digest list is not a JSON object")
    state = tuple((name, _stat(path / name)) for name in sorted(digests))
    if _verified.get(Path(path)) == state:
        return                      # checked in this process already, and no file changed since
    for name, want in digests.items():
        if (path / name).is_file() and file_digest(path / name) != want:
            raise files.CorruptFile(f"{path / name}: its content changed after it was written (sha256 differs "
                                    "from the one complete.json recorded)")
    _verified[Path(path)] = state


def _stat(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, read in 4 MiB pieces (a checkpoint's optimizer state can be gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for piece in iter(lambda: fh.read(4 << 20), b""):
            h.update(piece)
    return f"sha256:{h.hexdigest()}"


def save_checkpoint(output_dir: Path, step: int, identity: dict, pipeline_state: dict,
                    write_backend_state, keep_last_n: int | None, ranks) -> Path:
    """Write one checkpoint atomically; `write_backend_state(dir)` saves weights and optimizer
    (collectively, in a distributed run: every rank calls this, each with its `ranks`, distributed.Ranks)."""
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
    newest = newest_complete(output_dir)
    kept = (f"the newest complete checkpoint, {newest}, is kept: free space, then continue from it with --resume"
            if newest else "no earlier checkpoint was written")
    with files.write_errors(f"writing checkpoint {final}", root, cleanup=staging, kept=kept):
        write_backend_state(staging)
        ranks.barrier()
        if ranks.is_main:
            _finish(output_dir, root, staging, final, step, identity, pipeline_state, keep_last_n)
    ranks.barrier()
    return final


def _finish(output_dir, root: Path, staging: Path, final: Path, step: int, identity: dict, pipeline_state: dict,
            keep_last_n: int | None) -> None:
    (staging / STATE).write_text(json.dumps(pipeline_state), encoding="utf-8")
    # The size and sha256 of every file, so a later truncation, a file gone or bytes changed in place show
    # before anything loads it.
    names = [p.relative_to(staging).as_posix() for p in sorted(staging.rglob("*")) if p.is_file()]
    written = {name: (staging / name).stat().st_size for name in names}
    digests = {name: file_digest(staging / name) for name in names}
    (staging / MARKER).write_text(json.dumps({"step": step, **identity, "files": written, DIGESTS: digests}),
                                  encoding="utf-8")
    _fsync_dir(staging)
    if final.exists():            # a checkpoint of this step from an earlier attempt
        if checkpoint_problem(final) is None:
            shutil.rmtree(final)
        else:                     # one --resume skipped as damaged: kept for inspection, under a name never read
            os.replace(final, root / f".damaged-{final.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.replace(staging, final)
    for known in (_unloadable, _verified):      # what this process knew of the one replaced
        known.pop(final, None)
    _reported.discard(final)
    _fsync_dir(root)
    if keep_last_n:
        for old in list_checkpoints(output_dir)[:-keep_last_n]:
            shutil.rmtree(old, ignore_errors=True)


def both_kinds(path: Path) -> str:
    """A checkpoint is written by one process (PLAIN) or by several (SHARDED), never both: one holding both
    was changed after it was written (a planted sharded/ would make the loader unpickle it)."""
    return (f"{path} holds both {PLAIN} (written by one process) and {SHARDED}/ (written by several); no run "
            "writes both, so it was changed after it was written and is not read")


def read_checkpoint(path: Path, identity: dict) -> dict:
    """The pipeline state of a checkpoint, after checking it belongs to this run."""
    marker = files.read_json(path / MARKER)
    for key, want in identity.items():
        have = marker.get(key)
        if have != want:
            raise MudpuppyError(
                f"cannot resume from {path}: it was made with {key}={have!r}, this config has {key}={want!r}; "
                "use the original config, or a new output_dir to start over")
    return files.read_json(path / STATE)


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
