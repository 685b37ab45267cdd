"""`mudpuppy chat` from a pipe, given what a user may give it: bytes that are not UTF-8, a temperature
near 0. One message or an answer, never a traceback."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from mudpuppy.serving import GenerationOptions

from ..conftest import REPO


def chat(chat_run, stdin: bytes, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LC_ALL": "C"}     # a locale that is not UTF-8's
    return subprocess.run([sys.executable, "-m", "mudpuppy", "chat", str(chat_run), "--backend", "cpu",
                           "--precision", "fp32", "--max-new-tokens", "6", *flags],
                          input=stdin, capture_output=True, cwd=REPO, env=env, timeout=180)


def test_bytes_that_are_not_utf8_end_the_chat_with_a_message_naming_the_line(chat_run, torch_chat):
    first = torch_chat.complete([{"role": "user", "content": "Turn on the kitchen light."}],
                                GenerationOptions(max_new_tokens=6)).text
    result = chat(chat_run, "Turn on the kitchen light.\n".encode() + b"caf\xe9 au lait\nnot read\n")
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "stdin line 2: not UTF-8 text (byte 0xe9 at byte 4 of the line)" in err
    assert "Traceback" not in err
    assert result.stdout.decode("utf-8") == first + "\n"      # the answers before it stand


def test_utf8_is_read_whatever_the_locale_and_a_tiny_temperature_is_greedy(chat_run, torch_chat):
    question = "Dim the hallway to 30 % — now, please ☺"
    greedy = torch_chat.complete([{"role": "user", "content": question}], GenerationOptions(max_new_tokens=6)).text
    result = chat(chat_run, ("\ufeff" + question + "\n").encode(), "--temperature", "1e-300", "--seed", "1")
    err = result.stderr.decode()
    assert result.returncode == 0 and "Traceback" not in err, err
    assert result.stdout.decode("utf-8") == greedy + "\n"


@pytest.mark.parametrize("errors", ["surrogateescape", "strict"])
def test_at_a_prompt_a_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(torch_chat, errors):
    """Python's stdin hands bytes that are not UTF-8 over as lone surrogates (surrogateescape: its choice
    under a C or UTF-8 locale) or raises (strict). At a real terminal, readline in a C locale takes such a
    byte for a Meta key and the line never holds it; this is the prompt without readline."""
    from mudpuppy.serving.chat import ChatSession, run_chat

    expected = torch_chat.complete([{"role": "user", "content": "hello"}], GenerationOptions(max_new_tokens=6)).text
    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait\nhello\n/quit\n"), encoding="utf-8", errors=errors)
    if errors == "strict":       # the decoder fails on the whole chunk read: one line at a time, as a terminal
        stdin = io.TextIOWrapper(io.BufferedReader(OneLine(b"caf\xe9 au lait\nhello\n/quit\n")), encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    run_chat(ChatSession(torch_chat, GenerationOptions(max_new_tokens=6)), stdin, out, err, interactive=True)
    assert "that line is not UTF-8 text (byte 0xe9 at byte 4 of the line); type it again" in err.getvalue()
    assert out.getvalue() == f"> > {expected}\n> "      # the refused line has no answer


class OneLine(io.RawIOBase):
    """A raw stream that gives one line per read, as a terminal in canonical mode does."""

    def __init__(self, data: bytes):
        self.lines = data.splitlines(keepends=True)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if not self.lines:
            return 0
        line = self.lines.pop(0)
        buffer[:len(line)] = line
        return len(line)


@pytest.mark.parametrize("command, flag, value", [
    ("chat", "--temperature", "nan"), ("chat", "--temperature", "inf"), ("chat", "--top-p", "nan"),
    ("serve", "--temperature", "nan"), ("serve", "--max-body", "inf"), ("serve", "--request-timeout", "nan"),
    ("chat", "--seed", str(2**64)), ("serve", "--seed", str(-2**63 - 1)),      # torch's seed is 64 bits
])
def test_a_flag_out_of_its_range_is_refused_before_loading(command, flag, value, tmp_path):
    """nan passes a range's comparisons: a NaN temperature failed inside transformers with a traceback, and
    a seed beyond 64 bits in torch ("Overflow when unpacking long long")."""
    from click.testing import CliRunner

    from mudpuppy.cli import main

    result = CliRunner().invoke(main, [command, str(tmp_path / "never-loaded"), flag, value], input="hi\n")
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{flag}': " in result.output
    assert ("is not a finite number." if flag != "--seed" else "is not in the range") in result.output
    assert "loading" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
