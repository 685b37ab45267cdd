"""`mudpuppy serve` bounded: bodies and prompts refused before they cost anything, connections beyond the
pool answered 503, never reset, and a client that drops its connection is one line in the log."""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time

import pytest

from .test_server_limits import QUESTION, Server, wait_for

BIG = 15 * 2**20


@pytest.fixture(scope="module")
def server(nonstop):
    srv = Server(nonstop, max_tokens=64)
    yield srv
    srv.close()


def post_raw(port: int, head: bytes, body: bytes = b"", timeout: float = 30) -> bytes:
    """Send a request as bytes; everything the server answers until it closes the connection."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        sock.sendall(head + body)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data
    finally:
        sock.close()


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def json_of(answer: bytes) -> dict:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])


def test_a_body_above_max_body_is_refused_unread_and_the_client_sees_the_413(nonstop):
    srv = Server(nonstop, max_body=64 * 2**10)
    try:
        payload = json.dumps({"messages": [{"role": "user", "content": "x" * BIG}]}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        started = time.monotonic()
        conn.request("POST", "/v1/chat/completions", body=payload, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()       # no reset: the server read and dropped the body after answering
        body = json.loads(resp.read())
        elapsed = time.monotonic() - started
        conn.close()
        assert resp.status == 413 and body["error"]["code"] == "request_too_large", body
        assert f"{len(payload)} bytes" in body["error"]["message"] and "--max-body" in body["error"]["message"]
        assert elapsed < 2, elapsed
        assert srv.answers()
    finally:
        srv.close()


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(nonstop, monkeypatch):
    srv = Server(nonstop, max_body=32 * 2**20)
    try:
        calls = []
        model = srv.srv.model
        monkeypatch.setattr(type(model), "prompt_ids", lambda self, m: calls.append(1) or [])
        started = time.monotonic()
        status, body, _ = srv.request({"messages": [{"role": "user", "content": "light " * (BIG // 6)}]})
        elapsed = time.monotonic() - started
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        assert body["error"]["param"] == "messages" and "characters" in body["error"]["message"]
        assert elapsed < 2 and not calls, elapsed
        monkeypatch.undo()
        assert srv.answers()
    finally:
        srv.close()


def test_the_character_bound_never_refuses_a_prompt_that_fits(server, nonstop):
    """At the bound, messages are always more tokens than the context: one character short of it, the
    token count decides (a 400 from the tokenizer's count, not the character one)."""
    limit, context = server.srv.prompt_chars, server.srv.context
    longest = max(map(len, nonstop.tokenizer.get_vocab()))
    assert limit == context * longest
    text = "a" * (limit - 40)           # the template's own characters are not counted
    status, body, _ = server.request({"messages": [{"role": "user", "content": text}]})
    assert status == 400 and "characters" not in body["error"]["message"]
    assert len(nonstop.prompt_ids([{"role": "user", "content": text}])) > context


@pytest.mark.parametrize("headers, status, code", [
    (b"Content-Length: +5\r\n", 400, "invalid_content_length"),
    (b"Content-Length: 5_0\r\n", 400, "invalid_content_length"),
    (b"Content-Length: 2\r\nContent-Length: 2\r\n", 400, "invalid_content_length"),
    (b"Transfer-Encoding: chunked\r\n", 411, "length_required"),
    (b"Transfer-Encoding: chunked\r\nContent-Length: 2\r\n", 400, "invalid_content_length"),
])
def test_a_body_whose_length_is_not_one_plain_number_is_refused(server, headers, status, code):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + headers
            + b"\r\n")
    answer = post_raw(server.port, head, b"{}")
    assert status_of(answer) == status and json_of(answer)["error"]["code"] == code, answer
    assert server.answers()


@pytest.mark.parametrize("sent", [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty",            # mid-headers
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n{\"messages\": [",                                      # mid-body
])
def test_a_client_that_resets_mid_request_is_one_log_line(server, capfd, sent):
    seen = len(server.lines)
    sock = socket.create_connection(("127.0.0.1", server.port))
    local = sock.getsockname()
    sock.sendall(sent)
    time.sleep(0.2)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # close with a reset
    sock.close()
    assert wait_for(lambda: len(server.lines) > seen, 10)
    time.sleep(0.3)
    new = server.lines[seen:]
    assert new == [f"{local[0]}:{local[1]}: the client dropped the connection (ConnectionResetError)"], new
    assert "Traceback" not in capfd.readouterr().err
    assert server.answers()


def test_connections_beyond_the_pool_get_a_503_with_retry_after(nonstop):
    srv = Server(nonstop, max_connections=2)
    idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(2)]   # each holds a worker
    try:
        assert wait_for(lambda: len(srv.srv.connections) == 2, 10)
        status, body, headers = srv.request({"messages": QUESTION, "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == "overloaded", body
        assert headers["Retry-After"] == "1" and "--max-connections" in body["error"]["message"]
        # a refused body is read, so the client sees the 503 and not a reset
        payload = json.dumps({"messages": [{"role": "user", "content": "x" * 2**20}]}).encode()
        status, body, _ = srv.request(raw=payload)
        assert status == 503
    finally:
        for sock in idle:
            sock.close()
    try:
        assert wait_for(srv.answers, 10)
    finally:
        srv.close()


@pytest.mark.parametrize("pool", [128, 6])
def test_concurrent_clients_get_an_answer_or_a_503_never_a_reset(nonstop, pool):
    """24 clients, a new connection per request, for 4 s: each connection is answered 200 or (beyond a
    pool of 6) 503; none is reset or left unanswered. benchmarks/serve_flood.py runs 64 for 20 s."""
    srv = Server(nonstop, max_connections=pool, max_tokens=8)
    outcomes: list[str] = []
    lock = threading.Lock()
    end = time.monotonic() + 4

    def client(i: int) -> None:
        while time.monotonic() < end:
            try:
                status, _, headers = srv.request({"messages": QUESTION, "max_tokens": 2})
                got = str(status) if status != 503 or headers.get("Retry-After") else "503 without Retry-After"
            except OSError as exc:
                got = type(exc).__name__
            with lock:
                outcomes.append(got)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        srv.close()
    counts = {o: outcomes.count(o) for o in set(outcomes)}
    assert set(counts) <= {"200", "503"}, counts
    assert counts.get("200", 0) >= 24, counts
    if pool == 128:
        assert "503" not in counts, counts
    else:
        assert counts.get("503", 0) > 0, counts


def test_many_short_messages_are_refused_before_tokenizing(server):
    """Empty messages pass the count of message characters; rendered, each is a turn of template text."""
    messages = [{"role": "user", "content": ""}] * 5000
    started = time.monotonic()
    status, body, _ = server.request({"messages": messages})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "rendered messages have" in body["error"]["message"]
    assert time.monotonic() - started < 5
    assert server.answers()
