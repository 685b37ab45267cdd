"""One writer at a time: the flock'ed lock files of the output contract, and who holds one.

An output beside its target is locked by `.NAME.mudpuppy-lock` (staging.py), a run folder by
`.mudpuppy-run.lock` inside it (rundir.py); both go through acquire_lock, which writes the holder's pid
and command into the file so the process stopped by it can say who is in the way. The kernel drops a
flock when its process ends, however it ends (SIGKILL included), so a stale file never blocks anyone.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

from ..errors import OutputExists

try:
    import fcntl
except ImportError:                      # not a POSIX system: writes go unlocked (acquire_lock says so)
    fcntl = None


class OutputInUse(OutputExists):
    """Another process is writing this output."""


def acquire_lock(path: Path, what: str, instead: str, error=OutputInUse) -> int | None:
    """flock `path` (created when missing) and write this process's pid and command into it; `error` names
    the holder when another process has it. None on a filesystem without flock (warned once)."""
    for _ in range(5):       # a holder that just released may have unlinked the file we opened: open it again
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise OutputExists(f"{what}: cannot write there ({exc.strerror})") from None
        try:
            if fcntl is None:
                raise OSError(0, "no flock on this system")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise error(f"{what} is in use by another mudpuppy process ({holder}); wait for it to end (or stop "
                        f"it), or choose another {instead}") from None
        except OSError as exc:      # a filesystem without flock (some network mounts): write, but say so
            os.close(fd)
            print(f"warning: {what} cannot be locked ({exc.strerror}); make sure no other process writes there",
                  file=sys.stderr)
            return None
        if _same_file(fd, path):
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "command": command(),
                             "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode() + b"\n")
    return fd


def release_lock(fd: int | None, unlink: Path | None = None) -> None:
    """Drop the lock; `unlink` (a lock file beside an output, not inside a run) is removed first, while held."""
    if fd is None:
        return
    if unlink is not None:
        with contextlib.suppress(OSError):
            os.unlink(unlink)
    os.ftruncate(fd, 0)                  # no pid left behind to mislead a reader
    os.close(fd)                         # closing drops the flock


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        info = {}
    if not info.get("pid"):
        return "starting up"
    return f"pid {info['pid']}: {info.get('command', '?')}, since {info.get('since', '?')}"


def command() -> str:
    args = [Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python", *sys.argv[1:]]
    return " ".join(args)[:500]


def pid_running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:              # another user's process: running
        return True
    except (OverflowError, ValueError, OSError):
        return False
    return True
