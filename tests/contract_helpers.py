"""Helpers for the output contract's tests (tests/training/test_output_contract.py,
tests/export/test_export_contract.py): the real command line in a subprocess, and a command held at a
chosen point (after a given function ran, or before) until the test lets it go or kills it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

# `mudpuppy ARGS...` in which the function TARGET ("module:name") is wrapped: at its call (WHEN "before")
# or on its return ("after") the process touches READY and waits until GATE exists.
HELD = """
import importlib, sys, time
from pathlib import Path
target, when, ready, gate = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
del sys.argv[1:5]
module, name = target.split(":")
owner = importlib.import_module(module)
real = getattr(owner, name)
def hold():
    ready.touch()
    while not gate.exists():
        time.sleep(0.05)
def held(*args, **kwargs):
    if when == "before":
        hold()
    result = real(*args, **kwargs)
    if when == "after":
        hold()
    return result
setattr(owner, name, held)
from mudpuppy.cli import main
sys.argv[0] = "mudpuppy"
main()
"""


def cli(*args, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mudpuppy.cli", *[str(a) for a in args]], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


class Held:
    """A `mudpuppy` command held at `target`: `wait()` until it is there, then `release()` or `kill()`."""

    def __init__(self, tmp: Path, target: str, when: str, *args):
        tmp.mkdir(parents=True, exist_ok=True)
        self.ready, self.gate = tmp / f"ready-{time.monotonic_ns()}", tmp / f"gate-{time.monotonic_ns()}"
        script = tmp / "held.py"
        script.write_text(HELD)
        self.proc = subprocess.Popen([sys.executable, str(script), target, when, str(self.ready), str(self.gate),
                                      *[str(a) for a in args]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=dict(os.environ))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"ended before it was held: {self.proc.communicate()}")
            if time.time() > deadline:
                self.proc.kill()
                raise AssertionError("never reached the point it is held at")
            time.sleep(0.05)

    def release(self, timeout: float = 300) -> tuple[int, str, str]:
        self.gate.touch()
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=60)


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error")]


def one_error(done: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, one `error:` line holding every needle, no traceback."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = error_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def dead_pid() -> int:
    """The pid of a process that has ended (what a killed writer leaves in its staging folder's name)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))
