"""`mudpuppy init` checks each answer as it is given (issue 39): a data path that does not exist is said
right after it is typed and asked again, before the next question, not after all of them."""

from __future__ import annotations

import os
import pty
import select
import signal
import sys
import time

import pytest
from click.testing import CliRunner

from mudpuppy.cli import main
from mudpuppy.configure import load_config

from ..conftest import QUICKSTART_DATA

TRAIN = str(QUICKSTART_DATA / "smart_home_train.jsonl")


def converse(target, cwd, script, timeout=60):
    """Run `mudpuppy init TARGET` on a terminal; `script` is (text to wait for, answer) pairs, in order. Returns
    the exit code and everything the terminal showed, with where each awaited text first appeared."""
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(cwd)
        os.execv(sys.executable, [sys.executable, "-m", "mudpuppy", "init", str(target)])
    seen, sent, deadline = "", 0, time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([fd], [], [], 1)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        seen += chunk.decode(errors="replace")
        if sent < len(script) and seen.rstrip().endswith(":") and seen.count(script[sent][0]) >= script[sent][2]:
            os.write(fd, script[sent][1].encode() + b"\r")
            sent += 1
    done, status = os.waitpid(pid, os.WNOHANG)
    if not done:                                    # stuck at a question the script did not expect
        time.sleep(2)
        done, status = os.waitpid(pid, os.WNOHANG)
    if not done:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), seen


def test_a_missing_data_file_is_said_at_once_and_asked_again(tmp_path):
    target = tmp_path / "asked.yaml"
    script = [("Base model", "", 1),
              ("Training data file", "no-such.jsonl", 1),
              ("Training data file", TRAIN, 2),          # asked again, before the method
              ("Method", "lora", 1), ("Backend", "cpu", 1), ("Output directory", "outputs/x", 1)]
    code, seen = converse(target, tmp_path, script)
    assert code == 0, seen
    error = seen.index("no-such.jsonl does not exist")
    assert error < seen.index("Method")                 # said before the next question
    assert seen.count("Training data file") == 2
    assert load_config(target).backend == "cpu"


def test_a_model_path_that_is_not_there_is_said_before_the_data_question(tmp_path):
    target = tmp_path / "asked.yaml"
    script = [("Base model", "./no-such-model", 1), ("Base model", "", 2), ("Training data file", TRAIN, 1),
              ("Method", "lora", 1), ("Backend", "cpu", 1), ("Output directory", "outputs/x", 1)]
    code, seen = converse(target, tmp_path, script)
    assert code == 0, seen
    assert seen.index("./no-such-model does not exist") < seen.index("Training data file")


@pytest.mark.parametrize("flags, says", [
    (["--model", "./no-such-model", "--data", TRAIN], "model: ./no-such-model does not exist"),
    (["--data", TRAIN, "--val-data", "nope.jsonl"], "--val-data: nope.jsonl does not exist"),
    (["--data", str(QUICKSTART_DATA)], "is a directory"),
    (["--data", TRAIN, "--output", TRAIN], "is a file"),
])
def test_flags_are_checked_the_same_way(tmp_path, flags, says):
    target = tmp_path / "x.yaml"
    res = CliRunner().invoke(main, ["init", str(target), *flags, "--yes"])
    assert res.exit_code == 2 and says in res.output, res.output
    assert not target.exists()
