"""`mudpuppy serve` under abuse: limits refused as 400s, clients that leave, time limits, keys and origins."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from mudpuppy.serving import GenerationOptions
from mudpuppy.serving.server import ServerLimits, start_server

QUESTION = [{"role": "user", "content": "Turn on the kitchen light."}]
CONTEXT = 512          # the tiny model's max_position_embeddings


class Server:
    def __init__(self, model, **limits):
        self.lines: list[str] = []
        self.srv = start_server(model, "127.0.0.1", 0, GenerationOptions(max_new_tokens=8, temperature=0.0),
                                log=self.lines.append, limits=ServerLimits(**limits))
        self.port = self.srv.server_port
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()

    def request(self, body=None, raw: bytes | None = None, method: str = "POST", path: str = "/v1/chat/completions",
                headers: dict | None = None) -> tuple[int, dict, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        sent = {"Content-Type": "application/json"} if data is not None else {}
        sent.update(headers or {})
        conn.request(method, path, body=data, headers=sent)
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        return resp.status, (json.loads(text) if text else {}), dict(resp.getheaders())

    def answers(self) -> bool:
        status, body, _ = self.request({"messages": QUESTION, "max_tokens": 2})
        return status == 200 and body["choices"][0]["message"]["role"] == "assistant"


@pytest.fixture(scope="module")
def server(nonstop):
    srv = Server(nonstop, max_tokens=1000)
    yield srv
    srv.close()


def body_with(**fields) -> bytes:
    return json.dumps({"messages": QUESTION, **fields}).encode()


def raw_with(field: str, literal: str) -> bytes:
    """A body with a literal json.dumps would not write (NaN, 1e999, ...)."""
    return b'{"messages": ' + json.dumps(QUESTION).encode() + f', "{field}": {literal}}}'.encode()


@pytest.mark.parametrize("raw, param, code", [
    (body_with(max_tokens=10**9), "max_tokens", "invalid_value"),                 # above --max-tokens
    (body_with(max_completion_tokens=10**9), "max_completion_tokens", "invalid_value"),
    (body_with(max_tokens=CONTEXT), "max_tokens", "context_length_exceeded"),    # above the context left
    (json.dumps({"messages": [{"role": "user", "content": "light " * 3000}]}).encode(), "messages",
     "context_length_exceeded"),
    (raw_with("temperature", "NaN"), None, "invalid_json"),
    (raw_with("top_p", "NaN"), None, "invalid_json"),
    (raw_with("temperature", "Infinity"), None, "invalid_json"),
    (raw_with("temperature", "1e999"), "temperature", "invalid_value"),          # parses as inf
    (body_with(seed=2**70), "seed", "invalid_value"),
    (body_with(seed=-2**70), "seed", "invalid_value"),
    (body_with(top_k=2**40), "top_k", "invalid_value"),
    (body_with(stop="x" * 513), "stop", "invalid_value"),                         # costs its length squared
    (body_with(stop=["end", "y" * 100_000]), "stop", "invalid_value"),
    (raw_with("seed", "1" * 5000), None, "invalid_json"),                        # beyond Python's int digits
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', None, "invalid_json"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "user": {"\\udfff": 1}}', None, "invalid_json"),
    (b'{"messages": ' + b"[" * 100 + b"]" * 100 + b"}", None, "invalid_json"),
    (b'{"messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", None, "invalid_json"),   # RecursionError
])
def test_limits_and_bad_values_are_400s_and_the_server_goes_on(server, raw, param, code):
    status, body, _ = server.request(raw=raw)
    assert status == 400, body
    assert (body["error"]["param"], body["error"]["code"]) == (param, code)
    assert server.answers()


def test_max_tokens_left_out_is_cut_to_the_context(nonstop, torch_chat):
    srv = Server(nonstop, max_tokens=CONTEXT)
    try:
        prompt = len(torch_chat.prompt_ids(QUESTION))
        srv.srv.defaults = GenerationOptions(max_new_tokens=CONTEXT, temperature=0.0)
        status, body, _ = srv.request({"messages": QUESTION})
        assert status == 200 and body["usage"]["completion_tokens"] == CONTEXT - prompt
        assert body["choices"][0]["finish_reason"] == "length"
    finally:
        srv.close()


def read_stream(resp) -> list[str]:
    """Server-sent events until [DONE] or the end of the body."""
    events = []
    while True:
        line = resp.readline()
        if not line:
            return events
        if line.startswith(b"data: "):
            events.append(line[6:].strip().decode())
            if events[-1] == "[DONE]":
                return events


def test_a_long_answer_does_not_hold_the_model(server):
    """One client asks for 900 tokens; another gets its short answer while the first is still decoding."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=body_with(max_tokens=CONTEXT - 40, stream=True),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: ")
    started = time.monotonic()
    status, body, _ = server.request({"messages": [{"role": "user", "content": "Dim the hallway."}],
                                      "max_tokens": 3})
    waited = time.monotonic() - started
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    events = read_stream(resp)
    total = time.monotonic() - started
    conn.close()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert waited < total / 2, (waited, total)
    assert max(server.srv.scheduler.batch_sizes()) >= 2


def test_concurrent_answers_are_batched_and_equal_single_ones(server, nonstop):
    questions = [[{"role": "user", "content": text}] for text in
                 ("Turn on the kitchen light.", "Dim the hallway to 30%.", "Lock the front door.",
                  "What is the temperature in the bedroom?")]
    greedy = [nonstop.complete(q, GenerationOptions(max_new_tokens=12)).text for q in questions]
    seeded = [nonstop.complete(q, GenerationOptions(max_new_tokens=12, temperature=1.1, top_k=30, seed=5 + i)).text
              for i, q in enumerate(questions)]
    before = dict(server.srv.scheduler.batch_sizes())
    results: dict[tuple[str, int], str] = {}

    def ask(kind: str, i: int) -> None:
        fields = {"temperature": 0} if kind == "greedy" else {"temperature": 1.1, "top_k": 30, "seed": 5 + i}
        status, body, _ = server.request({"messages": questions[i], "max_tokens": 12, **fields})
        assert status == 200
        results[kind, i] = body["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=ask, args=(kind, i)) for kind in ("greedy", "seeded") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results["greedy", i] for i in range(4)] == greedy
    assert [results["seeded", i] for i in range(4)] == seeded
    after = server.srv.scheduler.batch_sizes()
    assert any(size > 1 and after[size] > before.get(size, 0) for size in after)


def wait_for(predicate, seconds: float = 20.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_stops_its_generation(server, stream):
    scheduler = server.srv.scheduler
    cancelled = scheduler.counts["cancelled"]
    sock = socket.create_connection(("127.0.0.1", server.port))
    payload = body_with(max_tokens=CONTEXT - 40, stream=stream)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    assert wait_for(lambda: scheduler.active)             # decoding
    sock.close()
    assert wait_for(lambda: scheduler.counts["cancelled"] == cancelled + 1)
    assert wait_for(lambda: not scheduler.active)
    assert any("the client left" in line for line in server.lines)
    assert server.answers()


def test_the_time_limit_ends_an_answer_as_length(nonstop):
    srv = Server(nonstop, request_timeout=0.05)
    try:
        status, body, _ = srv.request({"messages": QUESTION, "max_tokens": CONTEXT - 40})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] < CONTEXT - 40
        assert srv.srv.scheduler.counts["timed_out"] == 1
    finally:
        srv.close()


def test_api_key_origin_content_type_and_host(torch_chat):
    srv = Server(torch_chat, api_key="sekrit", allow_origins=("https://app.example",))
    key = {"Authorization": "Bearer sekrit"}
    plain = {"messages": QUESTION, "max_tokens": 2}
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            status, body, sent = srv.request(plain, headers=headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
            assert sent.get("WWW-Authenticate") == "Bearer"
        assert srv.request(method="GET", path="/v1/models")[0] == 401
        assert srv.request(plain, headers=key)[0] == 200

        status, body, _ = srv.request(plain, headers={**key, "Origin": "https://evil.example"})
        assert status == 403 and body["error"]["code"] == "origin_not_allowed"
        status, _, sent = srv.request(plain, headers={**key, "Origin": "https://app.example"})
        assert status == 200 and sent["Access-Control-Allow-Origin"] == "https://app.example"
        assert srv.request(plain, headers={**key, "Origin": f"http://127.0.0.1:{srv.port}"})[0] == 200
        status, _, sent = srv.request(method="OPTIONS", headers={"Origin": "https://app.example",
                                                                 "Access-Control-Request-Method": "POST"})
        assert status == 204 and "Authorization" in sent["Access-Control-Allow-Headers"]

        # the cross-site "simple request": a page may POST text/plain without a preflight
        status, body, _ = srv.request(raw=json.dumps(plain).encode(),
                                      headers={**key, "Content-Type": "text/plain;charset=UTF-8"})
        assert status == 415 and body["error"]["code"] == "unsupported_media_type"
        # DNS rebinding: the page's own name pointed at 127.0.0.1
        status, body, _ = srv.request(plain, headers={**key, "Host": f"evil.example:{srv.port}"})
        assert status == 403 and body["error"]["code"] == "invalid_host"
        assert srv.request(plain, headers={**key, "Host": f"localhost:{srv.port}"})[0] == 200
    finally:
        srv.close()
