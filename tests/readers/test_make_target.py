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


def make_test_readers(tmp_path, installed: bool, stamped: bool = True, wheels: Path | None = None):
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    venv, fake = tmp_path / "venv", tmp_path / "fake"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    fake.mkdir(exist_ok=True)
    if installed:
        (fake / "llama_cpp").mkdir(exist_ok=True)
        (fake / "llama_cpp" / "__init__.py").write_text("")
    python = venv / "bin" / "python"
    python.write_text(PYTHON.format(fake=fake, real=sys.executable, log=tmp_path / "calls.log"))
    python.chmod(0o755)
    later = time.time() + 3600              # newer than pyproject.toml: make installs nothing
    for stamp in (".torch", ".installed", ".model") + ((".readers",) if stamped else ()):
        (venv / stamp).touch()
        os.utime(venv / stamp, (later, later))
    extra = [f"READERS_WHEELS={wheels}"] if wheels else []
    done = subprocess.run(["make", "-s", "-C", str(ROOT), "test-readers", f"VENV={venv}", *extra],
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


def pinned_spec() -> str:
    line = next(x for x in (ROOT / "pyproject.toml").read_text().splitlines() if "llama-cpp-python==" in x)
    return line[line.index("llama-cpp-python=="):].split('"')[0]


def test_the_wheel_is_built_once_into_a_folder_outside_the_clone_and_installed_from_it(tmp_path):
    """pip's own wheel cache is keyed by the sdist's URL, so a clone whose pip found the sdist elsewhere
    compiled llama.cpp again (33 min): the readers install builds the pinned wheel into READERS_WHEELS
    (kept when the clone or venv goes) and installs from there."""
    wheels = tmp_path / "wheels"
    done, calls = make_test_readers(tmp_path, installed=True, stamped=False, wheels=wheels)
    assert done.returncode == 0, done.stdout + done.stderr
    spec = pinned_spec()
    assert calls[0] == f"-m pip wheel -q --no-deps --find-links {wheels} -w {wheels} {spec}"
    assert calls[1] == f"-m pip install -q --find-links {wheels} -e .[readers]"
    assert calls[2:] == ["-m pytest -q -m readers"]
    assert wheels.is_dir() and f"building {spec} into {wheels}" in done.stdout
    version = spec.split("==")[1]
    (wheels / f"llama_cpp_python-{version}-py3-none-linux_x86_64.whl").write_bytes(b"")
    (tmp_path / "venv" / ".readers").unlink()
    again, _ = make_test_readers(tmp_path, installed=True, stamped=False, wheels=wheels)
    assert f"{spec} from the wheel built before, in {wheels}" in again.stdout
