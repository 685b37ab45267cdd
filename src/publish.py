"""The output contract: how every verb that writes puts its output in place, and what it may delete.

`export`, `merge`, `eval --out`, `convert-adapter` and a run's saves (its final model, GPTQ's and QAT's
models, the merge at its end, its held-out report) keep the same rules, all of them kept here:

1. Built beside, renamed into place. The output is written into a hidden staging folder beside its
   target, `.NAME.mudpuppy-new-PID` (PID: the writer's), and renamed into place only once every file
   is written. A failure or a kill before that leaves the target as it was.
2. The marker lists what mudpuppy wrote. Each kind of output has its record file, and it is the
   marker: `export.json` (export, merge), `eval.json` (eval). Its `files` lists the names this output
   put in the target: the entries of its own staging folder, which only the writing process fills
   (its pid names it, and the lock keeps every other writer out), stamped there with `"contract": 1`.
   Nothing is recorded by listing the target, so a file the user or another verb put there is never
   claimed.
3. `--overwrite` removes only those names, and only once the new output is complete and in place. A
   folder written before markers is adopted only for the names its kind's layout defines (an export's
   `export.json` names its format: the files that format writes).
4. One writer at a time: `.NAME.mudpuppy-lock` beside the target is flock'ed for the whole write; a
   second writer stops at once, naming the holder's pid and command.
5. The staging folders of a killed writer (the pid in their name runs no more) are removed by the
   next writer of the same target.

The run directory (training/rundir.py) is written as the run goes, so it keeps its own marker and lock
file inside it; it takes its lock and its layout matching from here.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import OutputExists
from .files import write_errors, write_json_atomic

try:
    import fcntl
except ImportError:                      # not a POSIX system: writes go unlocked (acquire_lock says so)
    fcntl = None

CONTRACT = 1                             # a record stamped with it lists exactly what its output wrote
# A writer's hidden folders beside its target: this module's, and the names `export` used before it.
STAGED = re.compile(r"^\.(?P<name>.+)\.(?:mudpuppy-(?:new|work|old)|export|work|old)-(?P<pid>\d+)$")


class OutputInUse(OutputExists):
    """Another process is writing this output."""


# --------------------------------------------------------------------------- what each verb writes
CARD_FILES = ("README.md", "export.json")
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
               "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
               "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
               "chat_template.json", "preprocessor_config.json", "processor_config.json")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapters.safetensors", "mudpuppy_base.json")
EXPORT_FILES = {"merged": MODEL_FILES + CARD_FILES, "mlx": MODEL_FILES + CARD_FILES,
                "gguf": ("model-*.gguf",) + CARD_FILES, "ollama": ("model-*.gguf", "Modelfile") + CARD_FILES}


def matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _adopt_export(folder: Path, record: dict) -> list[str]:
    """An export or merge written before the contract: the names its export.json lists that its format
    writes (a merge listed its folder after writing, so a file of yours could be among them)."""
    patterns = EXPORT_FILES.get(record.get("format"), sum(EXPORT_FILES.values(), ()))
    listed = record.get("files") if isinstance(record.get("files"), list) else None
    return [n for n in entries(folder) if matches(n, patterns) and (listed is None or n in listed)]


def _adopt_eval(folder: Path, record: dict) -> list[str]:
    """An evaluation written before the contract: eval.json, eval.md and the charts eval.json lists."""
    charts = [c for c in record.get("charts") or [] if isinstance(c, str) and matches(c, ("*.png",)) and "/" not in c]
    return [n for n in entries(folder) if n in ("eval.json", "eval.md", *charts)]


@dataclass(frozen=True)
class Kind:
    label: str                                        # for messages: "a mudpuppy export or merge"
    record: str | None = None                         # its record file: the marker of its folder
    adopt: Callable[[Path, dict], list[str]] | None = None   # its names in a folder written before the contract
    shares: bool = False                              # may go into a folder holding other files
    fixed: tuple[str, ...] = ()                       # names it always writes: checked before any work


EXPORT = Kind("a mudpuppy export or merge", "export.json", _adopt_export)
EVAL = Kind("an evaluation", "eval.json", _adopt_eval, shares=True, fixed=("eval.json", "eval.md"))
ADAPTER = Kind("a converted adapter")
KINDS = (EXPORT, EVAL)                                # those a folder inside a run may hold


# --------------------------------------------------------------------------- the marker
def earlier_output(folder: Path, kind: Kind) -> list[str] | None:
    """The names an earlier output of `kind` holds in `folder` (those still there), or None when the folder
    holds none: what its record lists, or for a record from before the contract, what `kind.adopt` allows."""
    record = _read_json(Path(folder) / kind.record) if kind.record else None
    if record is None:
        return None
    if record.get("contract") == CONTRACT and isinstance(record.get("files"), list):
        present = set(entries(folder))
        return [n for n in record["files"] if isinstance(n, str) and n in present]
    return kind.adopt(Path(folder), record) if kind.adopt else []


def stamp(folder: Path, kind: Kind, names, **extra) -> None:
    """`names` written into the record of `kind` in `folder` as what its output wrote (the record made if
    missing: the placeholder that marks a folder while an output moves in)."""
    path = Path(folder) / kind.record
    record = _read_json(path) or {}
    record.update(files=sorted(names), contract=CONTRACT, **extra)
    write_json_atomic(path, record)


def holds_output(folder: Path) -> bool:
    return any(earlier_output(folder, kind) is not None for kind in KINDS)


def remove_output(folder: Path) -> list[str]:
    """Every output's own names in `folder` (an output inside a run being replaced); the folder goes too when
    nothing else is left. Returns what stays (the user's); their folder keeps an emptied record, so the run's
    next output may go there again."""
    emptied = []
    for kind in KINDS:
        names = earlier_output(folder, kind)
        if names is not None:
            remove_names(folder, names)
            emptied.append(kind)
    left = entries(folder)
    if not left:
        folder.rmdir()
        return []
    for kind in emptied:
        stamp(folder, kind, [], emptied=True)
    return [n for n in left if n not in {k.record for k in emptied}]


def remove_names(folder: Path, names) -> None:
    for name in names:
        if not name or "/" in name or name in (".", ".."):
            continue                     # a record someone edited never reaches outside its folder
        path = Path(folder) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)    # a link goes, never what it points to


def entries(folder: Path) -> list[str]:
    """What `folder` holds ([] for a folder that does not exist)."""
    try:
        return sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []


# --------------------------------------------------------------------------- writing an output
class Writing:
    """One output being written: `dir` is its staging folder; `scratch()` a second one for what is needed
    only while writing (both go at the end, whatever happens)."""

    def __init__(self, target, kind: Kind, overwrite: bool, what: str, echo):
        self.shown = Path(target).expanduser()
        self.target = Path(os.path.realpath(self.shown))
        self.kind, self.overwrite, self.what, self.echo = kind, overwrite, what, echo
        self.parent, self.name, pid = self.target.parent, self.target.name, os.getpid()
        self.dir = self.parent / f".{self.name}.mudpuppy-new-{pid}"
        self._scratch = self.parent / f".{self.name}.mudpuppy-work-{pid}"
        self._old = self.parent / f".{self.name}.mudpuppy-old-{pid}"
        self.lock_path = self.parent / f".{self.name}.mudpuppy-lock"
        self.earlier: list[str] = []      # the names of the output this one replaces
        self.has_record = False           # whether the target holds this kind's record (its marker)
        self.names: list[str] = []        # what this output wrote, once published
        self.kept: list[str] = []         # what the target holds that is not this output's
        self._fd = None

    def scratch(self) -> Path:
        self._scratch.mkdir(exist_ok=True)
        return self._scratch

    def begin(self) -> None:
        if self.target.exists() and not self.target.is_dir():
            raise OutputExists(f"{self.what} {self.shown} is a file, not a directory")
        try:
            self.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputExists(f"{self.what} {self.shown}: cannot create it ({exc.strerror})") from None
        self._fd = acquire_lock(self.lock_path, f"{self.what} {self.shown}", self.what)
        remove_stale_staging(self.parent, self.name, self.echo)
        self._check()
        self.dir.mkdir()

    def _check(self) -> None:
        earlier = earlier_output(self.target, self.kind)
        present = entries(self.target)
        label, kind = f"{self.what} {self.shown}", self.kind
        if earlier:
            if not self.overwrite:
                where = self.shown / kind.record if kind.record and kind.record in earlier else label
                raise OutputExists(f"{where} already holds {kind.label}; pass --overwrite to replace it (only "
                                   f"the files it wrote; yours there stay), or choose another {self.what}")
        elif present and earlier is None and not kind.shares:
            even = " even with --overwrite" if self.overwrite else ""
            what = f" (no {kind.record})" if kind.record else ""
            raise OutputExists(f"{label} is not empty and does not look like {kind.label}{what}; refusing to "
                               f"write into it{even}; choose another {self.what}")
        self.earlier, self.has_record = earlier or [], earlier is not None
        clash = [n for n in kind.fixed if n in present and n not in self.earlier and n != kind.record]
        if clash:
            raise OutputExists(f"{label} holds {', '.join(clash)}, which mudpuppy did not write there; move "
                               f"{'it' if len(clash) == 1 else 'them'} or choose another {self.what}")

    def publish(self) -> list[str]:
        """Put the finished output in place; returns its names. A new target is the staging folder renamed
        (one atomic step); into an existing one each name is renamed in, and only then does the earlier
        output's rest go."""
        self.names = sorted(os.listdir(self.dir))        # this process's own folder: exactly what it wrote
        if self.kind.record:
            stamp(self.dir, self.kind, set(self.names) | {self.kind.record})
            self.names = sorted(os.listdir(self.dir))
        if not self.target.exists():
            try:
                os.rename(self.dir, self.target)
                return self.names
            except OSError as exc:          # the target appeared meanwhile (made by hand): go in name by name
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        self._move_in(self.names)
        return self.names

    def _move_in(self, names: list[str]) -> None:
        target, record = self.target, self.kind.record
        ours = set(self.earlier) | ({record} if self.has_record else set())
        clash = [n for n in names if os.path.lexists(target / n) and n not in ours]
        if clash:
            raise OutputExists(f"{self.what} {self.shown} holds {', '.join(clash)}, which mudpuppy did not write "
                               f"and this output would replace; nothing was replaced. Move "
                               f"{'it' if len(clash) == 1 else 'them'} or choose another {self.what}, and run again")
        if record:          # listed before they arrive: a kill between two renames leaves every name claimed
            stamp(target, self.kind, ours | set(names), complete=False)
        for name in [n for n in names if n != record]:
            self._replace(name)
        for name in sorted(set(self.earlier) - set(names)):
            if os.path.lexists(target / name):
                self._set_aside(target / name)
        if record:
            self._replace(record)         # last: the record now lists exactly the new output
        self.kept = [n for n in entries(target) if n not in names]

    def _replace(self, name: str) -> None:
        dest = self.target / name
        if dest.is_dir() and not dest.is_symlink():
            self._set_aside(dest)         # a folder is replaced whole: the old one waits beside until the end
        os.replace(self.dir / name, dest)

    def _set_aside(self, path: Path) -> None:
        self._old.mkdir(exist_ok=True)
        os.replace(path, self._old / path.name)

    def end(self) -> None:
        for folder in (self.dir, self._scratch, self._old):
            shutil.rmtree(folder, ignore_errors=True)
        release_lock(self._fd, self.lock_path)
        self._fd = None


@contextlib.contextmanager
def writing(target, kind: Kind, overwrite: bool = False, what: str = "--out", echo=None):
    """Write an output of `kind` to `target` under the contract: yields a Writing whose `dir` the caller fills;
    on success it is put in place (the earlier output's own files going last), on any failure or interrupt
    nothing in `target` changes and the staging folders go. A full disk ends in one WriteFailed."""
    out = Writing(target, kind, overwrite, what, echo or _stderr)
    try:
        out.begin()
        with write_errors(f"writing {out.shown}", out.parent, kept=f"nothing in {out.shown} was changed"):
            yield out
            out.publish()
        if out.earlier:
            out.echo(f"--overwrite: replaced the earlier output in {out.shown}"
                     + (f"; kept what mudpuppy did not write there: {', '.join(out.kept[:8])}" if out.kept else ""))
    finally:
        out.end()


def remove_stale_staging(parent: Path, name: str, echo=None) -> None:
    """The hidden folders a killed writer of `parent/name` left (its pid no longer runs). Called with the
    target's lock held, so no live writer of this target owns one."""
    try:
        found = os.listdir(parent)
    except OSError:
        return
    for entry in found:
        match = STAGED.match(entry)
        if not match or match["name"] != name or pid_running(int(match["pid"])):
            continue
        shutil.rmtree(parent / entry, ignore_errors=True)
        (echo or _stderr)(f"removed {parent / entry}, left by a mudpuppy process that ended before it finished "
                          f"(pid {match['pid']})")


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


# --------------------------------------------------------------------------- the lock
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


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)
