"""`mudpuppy serve` as a process: Ctrl-C and SIGTERM mid-stream end the stream with [DONE] and exit 0."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from ..conftest import REPO

QUESTION = [{"role": "user", "content": "Turn on the kitchen light."}]


def start(chat_run, *extra: str) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("MUDPUPPY_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "mudpuppy", "serve", str(chat_run), "--backend", "cpu",
                             "--precision", "fp32", "--port", "0", "--temperature", "0", *extra],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        found = re.search(r"at http://\S+:(\d+)/v1", line)
        if found:
            return proc, int(found.group(1))
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"the server did not start: {proc.stderr.read().decode()}")


@pytest.mark.parametrize("sig, host", [(signal.SIGINT, "127.0.0.1"), (signal.SIGTERM, "0.0.0.0")])
def test_a_signal_mid_stream_finishes_the_stream_and_exits_0(chat_run, sig, host):
    proc, port = start(chat_run, "--host", host, "--max-new-tokens", "400")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        # sampled at the highest temperature: the tiny model rarely meets its stop token within 400 tokens
        body = {"messages": QUESTION, "max_tokens": 400, "temperature": 2, "seed": 1, "stream": True}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events = [resp.readline(), resp.readline(), resp.readline()]      # the role chunk, a blank line, text
        proc.send_signal(sig)
        while (line := resp.readline()):
            events.append(line)
        conn.close()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    data = [e.decode().removeprefix("data: ").strip() for e in events if e.startswith(b"data: ")]
    assert data[-1] == "[DONE]"
    last = json.loads(data[-2])["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "length"
    assert len(data) < 400, "the answer ended before the signal came"
    stderr = err.decode()
    assert proc.returncode == 0, stderr
    assert "terminate called" not in stderr and "Traceback" not in stderr
    assert out.decode().rstrip().endswith("stopped")
    assert ("no API key" in stderr) == (host == "0.0.0.0")
