"""`make test-readers` runs the readers tier (`pytest -m readers`) where llama_cpp imports, and says so
and fails where it does not, rather than pass with every test skipped. Fast tier: the Makefile runs for
real against a stand-in virtual environment whose python logs each call and whose `-c` code sees a
stand-in llama_cpp, or none (tests/docs/test_makefile.py does the same for `make test-gpu`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = """#!/bin/sh
if [ "$1" = "-c" ]; then
    PYTHONPATH="{fake}" exec "{real}" -S "$@"
fi
echo "$@" >> "{log}"
"""


def make_test_readers(tmp_path, installed: bool):
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    venv, fake = tmp_path / "venv", tmp_path / "fake"
    (venv / "bin").mkdir(parents=True)
    fake.mkdir()
    if installed:
        (fake / "llama_cpp").mkdir()
        (fake / "llama_cpp" / "__init__.py").write_text("")
    python = venv / "bin" / "python"
    python.write_text(PYTHON.format(fake=fake, real=sys.executable, log=tmp_path / "calls.log"))
    python.chmod(0o755)
    later = time.time() + 3600              # newer than pyproject.toml: make installs nothing
    for stamp in (".torch", ".installed", ".model", ".readers"):
        (venv / stamp).touch()
        os.utime(venv / stamp, (later, later))
    done = subprocess.run(["make", "-s", "-C", str(ROOT), "test-readers", f"VENV={venv}"],
                          capture_output=True, text=True, timeout=120)
    log = tmp_path / "calls.log"
    return done, log.read_text().splitlines() if log.exists() else []


def test_the_readers_tier_runs_where_llama_cpp_imports(tmp_path):
    done, calls = make_test_readers(tmp_path, installed=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert calls == ["-m pytest -q -m readers"]


def test_without_llama_cpp_it_says_so_and_runs_nothing(tmp_path):
    done, calls = make_test_readers(tmp_path, installed=False)
    assert done.returncode != 0 and calls == []
    assert "llama_cpp does not import" in done.stdout + done.stderr
    assert "readers tier was not run" in done.stdout + done.stderr
