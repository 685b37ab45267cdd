"""Built beside, renamed into place: how `export`, `merge`, `eval --out`, `convert-adapter` and a run's own
outputs (its merged model, its held-out report) put a finished output where it belongs.

The output is written into a hidden staging folder beside its target, `.NAME.mudpuppy-new-PID` (PID: the
writer's), and renamed into place only once every file is written: a failure or a kill before that leaves
the target as it was. `--overwrite` removes only the names the earlier output's record lists
(records.py), and only once the new output is complete and in place. `.NAME.mudpuppy-lock` beside the
target is held for the whole write (locks.py); the staging folders of a killed writer (the pid in their
name runs no more) are removed by the next writer of the same target.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import sys
from pathlib import Path

from ..errors import OutputExists
from ..files import write_errors
from .locks import acquire_lock, pid_running, release_lock
from .records import Kind, earlier_output, entries, stamp

# A writer's hidden folders beside its target: this module's, and the names `export` used before it.
STAGED = re.compile(r"^\.(?P<name>.+)\.(?:mudpuppy-(?:new|work|old)|export|work|old)-(?P<pid>\d+)$")


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


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)
