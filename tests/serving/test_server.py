"""`mudpuppy serve`: OpenAI's shapes on a loopback port, errors that leave the server up, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.error
import urllib.request

import pytest

from mudpuppy.serving import GenerationOptions
from mudpuppy.serving.server import serve, start_server

QUESTION = [{"role": "user", "content": "Turn on the kitchen light."}]


@pytest.fixture(scope="module")
def server(torch_chat):
    lines: list[str] = []
    srv = start_server(torch_chat, "127.0.0.1", 0, GenerationOptions(max_new_tokens=16, temperature=0.0),
                       log=lines.append)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()
    srv.server_close()


def call(url: str, body=None, raw: bytes | None = None, method: str | None = None) -> tuple[int, dict | str]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            text = resp.read().decode()
            is_json = resp.headers.get("Content-Type", "").startswith("application/json")
            return resp.status, json.loads(text) if is_json else text
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read().decode())


def test_models_and_a_plain_answer(server, torch_chat):
    status, models = call(server + "/v1/models")
    assert status == 200 and models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [torch_chat.name] and models["data"][0]["object"] == "model"

    status, body = call(server + "/v1/chat/completions",
                        {"model": torch_chat.name, "messages": QUESTION, "temperature": 0, "max_tokens": 12})
    assert status == 200, body
    expected = torch_chat.complete(QUESTION, GenerationOptions(max_new_tokens=12))
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert choice["finish_reason"] == expected.finish_reason
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(torch_chat.prompt_ids(QUESTION))
    assert usage["completion_tokens"] == expected.completion_tokens > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def stream_events(url: str, body: dict) -> list[str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
        text = resp.read().decode()
    assert text.endswith("data: [DONE]\n\n")
    events = [block for block in text.split("\n\n") if block]
    assert all(e.startswith("data: ") for e in events)
    return [e.removeprefix("data: ") for e in events]


def test_streaming_answer_in_openai_chunks(server, torch_chat):
    body = {"messages": QUESTION, "temperature": 0, "max_tokens": 12, "stream": True,
            "stream_options": {"include_usage": True}}
    events = stream_events(server + "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    *answer, usage = chunks
    assert answer[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert answer[-1]["choices"][0]["delta"] == {} and answer[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in answer[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in answer)
    status, plain = call(server + "/v1/chat/completions", {"messages": QUESTION, "temperature": 0, "max_tokens": 12})
    assert text == plain["choices"][0]["message"]["content"] and len(answer) > 3
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]


def test_stop_strings_and_seeded_sampling(server, torch_chat):
    full = torch_chat.complete(QUESTION, GenerationOptions(max_new_tokens=16)).text
    stop = full.strip()[3:6]
    assert stop
    status, body = call(server + "/v1/chat/completions",
                        {"messages": QUESTION, "temperature": 0, "max_tokens": 16, "stop": [stop]})
    assert status == 200
    assert body["choices"][0]["message"]["content"] == full[:full.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"

    sampled = {"messages": QUESTION, "temperature": 1.2, "top_p": 0.9, "seed": 3, "max_tokens": 10}
    first, second = (call(server + "/v1/chat/completions", sampled)[1] for _ in range(2))
    assert first["choices"][0]["message"] == second["choices"][0]["message"]


@pytest.mark.parametrize("payload, status, param, code", [
    (b"{not json", 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, "invalid_json"),
    ({"model": "someone-else", "messages": QUESTION}, 404, "model", "model_not_found"),
    ({"temperature": 0.5}, 400, "messages", "missing_required_parameter"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "invalid_value"),
    ({"messages": QUESTION, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ({"messages": QUESTION, "top_p": 0}, 400, "top_p", "invalid_value"),
    ({"messages": QUESTION, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"messages": QUESTION, "stop": [1]}, 400, "stop", "invalid_value"),
    ({"messages": QUESTION, "n": 2}, 400, "n", "unsupported_value"),
])
def test_bad_requests_get_openai_errors_and_the_server_stays_up(server, payload, status, param, code):
    raw = payload if isinstance(payload, bytes) else None
    got, body = call(server + "/v1/chat/completions", None if raw else payload, raw=raw)
    assert got == status
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert (body["error"]["param"], body["error"]["code"]) == (param, code)
    ok, answer = call(server + "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2, "temperature": 0})
    assert ok == 200 and answer["choices"][0]["message"]["role"] == "assistant"


def test_unknown_urls(server):
    assert call(server + "/v1/completions", {"prompt": "x"})[1]["error"]["code"] == "unknown_url"
    status, body = call(server + "/v1/chat/completions")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"


def test_ctrl_c_stops_the_server_cleanly(torch_chat):
    """serve() in the main thread, as the CLI runs it; SIGINT arrives once it answers."""
    lines: list[str] = []
    ready = threading.Event()

    def echo(line: str) -> None:
        lines.append(line)
        if line.startswith("serving"):
            ready.set()

    def interrupt() -> None:
        assert ready.wait(60)
        url = lines[0].split(" at ", 1)[1] + "/models"
        with urllib.request.urlopen(url, timeout=30) as resp:
            lines.append(f"status {resp.status}")
        os.kill(os.getpid(), signal.SIGINT)

    # A shell starts background jobs with SIGINT ignored, and Python then installs no handler for it:
    # give this test the handler a terminal's process has, and put back whatever was there.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        thread = threading.Thread(target=interrupt, daemon=True)
        thread.start()
        serve(torch_chat, "127.0.0.1", 0, GenerationOptions(), echo=echo)
        thread.join(10)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "status 200" in lines and lines[-1] == "stopped"


def test_port_in_use_is_a_clear_error_before_any_model_loads(server, tmp_path):
    from click.testing import CliRunner

    from mudpuppy.cli import main

    port = int(server.rsplit(":", 1)[1])
    result = CliRunner().invoke(main, ["serve", str(tmp_path / "not-loaded"), "--port", str(port)])
    assert result.exit_code == 2 and f"--port {port}: cannot listen there" in result.stderr
    assert "not-loaded" not in result.stderr and "Traceback" not in result.output
