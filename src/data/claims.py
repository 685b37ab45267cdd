"""Folders a process writes a token store into, and the sweep that removes those their writers left behind.

A store is written into a folder of its own (a cache entry's staging folder,
or an uncached run's `<cache_dir>/.scratch/store-*`), which becomes an entry
only by rename once complete, or is removed once mapped. A process killed
in between (SIGKILL, the OOM killer, a lost node) cannot clean up, and a
store at scale is gigabytes, so each such folder has a claim: a lock file
beside it (`<folder>.lock`), held with `flock` by the writer for as long as
the folder is in use. The kernel drops the lock when its holder dies,
however it dies. The next writer sweeps the same parent folder first: a lock
file it can lock belongs to a dead process, and its folder goes.

A lock file is made under a name the sweep ignores, locked, and only then
renamed beside its folder, so the sweep never sees a claim before it is
held. Folders without a lock file (written before claims existed) go once
they are a day old. Where `fcntl` is missing (Windows) nothing is swept.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:          # Windows: folders are still removed by their writers, never swept
    fcntl = None

UNCLAIMED_AGE = 24 * 3600    # seconds before a folder with no lock file (an older version's) is stale
_HELD: dict[Path, Claim] = {}   # folder -> this process's claim on it


class Claim:
    """A fresh folder `parent/<prefix>XXXX` and the lock that says this process is writing it."""

    def __init__(self, parent: Path, prefix: str):
        parent.mkdir(parents=True, exist_ok=True)
        fd, making = tempfile.mkstemp(prefix=".claiming-", dir=parent)
        self._fd = fd
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:     # a file system without locks (some NFS): no sweep can take it either
                pass
        self.folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        self.lock = self.folder.with_name(self.folder.name + ".lock")
        os.replace(making, self.lock)
        _HELD[self.folder] = self

    def release(self, remove: bool = True) -> None:
        """The folder removed (unless `remove` is False: it was renamed into place), then the lock."""
        if remove:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.lock.unlink(missing_ok=True)
        os.close(self._fd)
        _HELD.pop(self.folder, None)


def release(folder: Path) -> None:
    """Remove a folder this process claimed (or, unclaimed, just the folder)."""
    claim = _HELD.get(Path(folder))
    if claim is not None:
        claim.release()
    else:
        shutil.rmtree(folder, ignore_errors=True)


def sweep(parent: Path, pattern: str) -> list[Path]:
    """Remove the folders in `parent` whose names match `pattern` (a regex) and whose writers are gone;
    returns them."""
    if fcntl is None or not parent.is_dir():
        return []
    gone = []
    for path in sorted(parent.iterdir()):
        name = path.name
        if name.startswith(".claiming-"):
            # Made moments before its writer locks it: only an old one is worth a try.
            if time.time() - path.stat().st_mtime > 60:
                _remove_if_dead(path, None)
        elif name.endswith(".lock") and re.fullmatch(pattern, name[: -len(".lock")]):
            if _remove_if_dead(path, path.with_name(name[: -len(".lock")])):
                gone.append(path.with_name(name[: -len(".lock")]))
        elif re.fullmatch(pattern, name) and path.is_dir() and not path.with_name(name + ".lock").exists() \
                and time.time() - path.stat().st_mtime > UNCLAIMED_AGE:
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone


def _remove_if_dead(lock: Path, folder: Path | None) -> bool:
    """Lock `lock` without waiting: held, its writer is alive; taken, the writer is dead and its folder goes
    (the lock held while removing, so two sweeps never race over one folder)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:             # removed meanwhile by its writer or another sweep
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        lock.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)
