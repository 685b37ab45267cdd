"""`mudpuppy chat` from a pipe, given what a user may give it: bytes that are not UTF-8, a temperature
near 0. One message or an answer, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

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
