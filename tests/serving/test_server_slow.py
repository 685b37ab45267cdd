"""`mudpuppy serve` against clients that send slowly (slowloris): each request's headers and body have a
deadline, so clients trickling bytes into every connection the server handles free them in time, and a
normal client gets its 200. Real sockets on 127.0.0.1, with timeouts of a second or two."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from .test_server_limits import QUESTION, Server

SLOW = 4               # as many slow clients as the server handles connections


@pytest.fixture()
def server(nonstop):
    srv = Server(nonstop, max_connections=SLOW, header_timeout=1.0, min_body_rate=1000.0)
    yield srv
    srv.close()


class Trickler(threading.Thread):
    """A client sending `head` and then one byte of `rest` every `gap` seconds, until the server closes
    the connection (or 30 s pass); keeps what the server answered."""

    def __init__(self, port: int, head: bytes, rest: bytes, gap: float = 0.2):
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.head, self.rest, self.gap = head, rest, gap
        self.answer, self.closed_after, self.eof = b"", None, False

    def run(self) -> None:
        start = time.monotonic()
        try:
            self.sock.sendall(self.head)
            for byte in self.rest:
                if self.server_spoke(self.gap):
                    break
                self.sock.sendall(bytes([byte]))
            while not self.eof and time.monotonic() - start < 30:
                self.server_spoke(0.5)
        except OSError:
            pass
        self.closed_after = time.monotonic() - start
        self.sock.close()

    def server_spoke(self, wait: float) -> bool:
        """Whether the server answered or closed within `wait` seconds."""
        self.sock.settimeout(wait)
        try:
            got = self.sock.recv(65536)
        except TimeoutError:
            return False
        self.answer += got
        self.eof = not got
        return True


def post_head(length: int | None = None) -> bytes:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return head + (f"Content-Length: {length}\r\n\r\n".encode() if length is not None else b"")


def answered_in_time(srv: Server, within: float) -> tuple[int, list[int]]:
    """A normal client asking until it gets something other than a 503 (the pool full), within `within` s."""
    statuses, deadline = [], time.monotonic() + within
    while time.monotonic() < deadline:
        status, _, _ = srv.request({"messages": QUESTION, "max_tokens": 2})
        statuses.append(status)
        if status != 503:
            return status, statuses
        time.sleep(0.2)
    return 0, statuses


def test_clients_trickling_headers_get_a_408_and_free_the_server_for_a_normal_client(server):
    slow = [Trickler(server.port, b"POST /v1/chat/completions HTTP/1.1\r\n", b"X-Slow: " + b"a" * 200)
            for _ in range(SLOW)]
    for client in slow:
        client.start()
    time.sleep(0.3)                     # every connection the server handles is taken
    status, statuses = answered_in_time(server, within=8.0)
    assert status == 200, statuses
    for client in slow:
        client.join(10)
        assert client.answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), client.answer[:200]
        assert b'"code": "request_timeout"' in client.answer
        assert client.closed_after < 5.0     # 1 s of headers, not a read timeout of 120 s per byte
    timed_out = [line for line in server.lines if "headers did not arrive within 1 s" in line]
    assert len(timed_out) == SLOW and all("answered 408" in line for line in timed_out), server.lines
    assert not any("Traceback" in line for line in server.lines)


def test_a_body_slower_than_the_minimum_rate_gets_a_408(server):
    body = json.dumps({"messages": QUESTION, "max_tokens": 2}).encode()
    # 1 s + len(body) bytes at 1000 bytes/s: about 1.1 s; at 5 bytes/s the body would take ~20 s
    client = Trickler(server.port, post_head(len(body)), body)
    client.start()
    client.join(10)
    assert client.answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), client.answer[:200]
    assert client.closed_after < 4.0
    assert any("body did not arrive" in line and "--min-body-rate" in line for line in server.lines), server.lines
    assert server.answers()


def test_a_connection_that_sends_nothing_is_closed_with_one_line_and_a_slow_but_timely_one_is_answered(server):
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    start = time.monotonic()
    assert idle.recv(100) == b""                        # closed, without an answer to a request never sent
    assert time.monotonic() - start < 4.0
    idle.close()
    assert sum("sent no request within 1 s (--header-timeout); closed" in line for line in server.lines) == 1
    body = json.dumps({"messages": QUESTION, "max_tokens": 2}).encode()
    late = Trickler(server.port, post_head(len(body))[:20], post_head(len(body))[20:40], gap=0.1)
    late.start()
    late.join(5)                                        # 20 bytes at 0.1 s: 2 s, past the header deadline
    assert late.answer.startswith(b"HTTP/1.1 408"), late.answer[:100]
    quick = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    for piece in (post_head(len(body))[:30], post_head(len(body))[30:], body):
        quick.sendall(piece)
        time.sleep(0.2)                                 # 0.4 s in all: within the deadlines
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += quick.recv(65536)
    quick.close()
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


def test_a_slow_client_beyond_the_pool_holds_the_overflow_thread_2_s_at_most(nonstop):
    srv = Server(nonstop, max_connections=SLOW, header_timeout=6.0)
    try:
        pool = [Trickler(srv.port, b"GET /v1/models HTTP/1.1\r\n", b"X-Slow: " + b"a" * 200) for _ in range(SLOW)]
        for client in pool:
            client.start()
        time.sleep(0.3)
        extra = Trickler(srv.port, b"GET /v1/models HTTP/1.1\r\n", b"X-Slow: " + b"a" * 200)
        extra.start()
        extra.join(10)
        # answered by the overflow thread's own 2 s deadline, while the pool's 6 s ones still hold
        assert extra.answer.startswith(b"HTTP/1.1 408"), extra.answer[:100]
        assert extra.closed_after < 4.0 and all(client.is_alive() for client in pool)
        status, _, headers = srv.request(method="GET", path="/v1/models")
        assert status == 503 and headers.get("Retry-After") == "1"       # the next one gets its 503 at once
        for client in pool:
            client.join(15)
            assert client.answer.startswith(b"HTTP/1.1 408")
    finally:
        srv.close()
