"""Connections to `mudpuppy serve`, bounded: every client gets an answer, or a 503, never a reset.

- The listen backlog holds BACKLOG connections (the kernel may cut it to net.core.somaxconn):
  Python's default of 5 reset clients as soon as a few dozen connected at once.
- At most `workers` connections are handled at once, each on a thread of its own (--max-connections).
  One more is answered by the overflow thread: its request is read (headers, and its body
  within the drain limit), answered 503 with `Retry-After`, and the connection closed. Beyond
  OVERFLOW waiting for that thread, a connection is closed unanswered: only a flood gets there.
- A connection closed while a request still has body bytes on their way resets the client, which
  then never sees the answer (a 413, a 401): `discard` reads and drops what is left of the body,
  up to DRAIN_LIMIT bytes within DRAIN_SECONDS, before the connection closes.
- A client that drops its connection is one line in the log, not a traceback (`dropped_line`).
- A client that sends slowly holds its thread only so long (`DeadlineReader`): a request's line and
  headers must arrive within --header-timeout of the wait for them starting, its body within that
  again plus its size at --min-body-rate. A per-read timeout alone let a client trickling one byte
  a minute hold a thread for ever, and --max-connections of them shut everyone else out
  (slowloris). Past the deadline the client gets a 408 and the connection closes; one that sent no
  byte of a request is closed (with one log line unless it is an idle keep-alive connection).
"""

from __future__ import annotations

import io
import json
import queue
import threading
import time
from typing import Callable

BACKLOG = 1024
OVERFLOW = 256              # connections waiting for the overflow thread's 503
RETRY_AFTER = 1             # seconds, in the 503's Retry-After
DRAIN_LIMIT = 64 * 2**20    # body bytes read and dropped after a refusal, at most
DRAIN_SECONDS = 10.0
CHUNK = 64 * 2**10


class Admission:
    """Hands each accepted connection to a worker thread of its own while fewer than `workers` run; the
    next ones to `refuse`, on one overflow thread, one at a time."""

    def __init__(self, workers: int, handle: Callable, refuse: Callable, close: Callable):
        self.slots = threading.BoundedSemaphore(workers)
        self.handle, self.refuse, self.close = handle, refuse, close
        self.waiting: queue.Queue = queue.Queue(OVERFLOW)
        self.overflow = threading.Thread(target=self.refuse_waiting, name="mudpuppy-overflow", daemon=True)
        self.overflow.start()

    def admit(self, request, address) -> None:
        if self.slots.acquire(blocking=False):
            threading.Thread(target=self.work, args=(request, address), daemon=True).start()
            return
        try:
            self.waiting.put_nowait((request, address))
        except queue.Full:
            self.close(request)

    def work(self, request, address) -> None:
        try:
            self.handle(request, address)
        finally:
            self.slots.release()

    def refuse_waiting(self) -> None:
        while True:
            item = self.waiting.get()
            if item is None:
                return
            try:
                self.refuse(*item)
            except Exception:   # the refusal's own failures are logged by it; this thread must go on
                pass

    def stop(self) -> None:
        """The overflow thread ends; connections still waiting for it are closed."""
        while True:
            try:
                item = self.waiting.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self.close(item[0])
        self.waiting.put(None)


def discard(rfile, size: int) -> bool:
    """Read and drop `size` body bytes; False when there were more than DRAIN_LIMIT, or they did not
    come within DRAIN_SECONDS (the connection then closes as it is)."""
    if size > DRAIN_LIMIT:
        return False
    deadline = time.monotonic() + DRAIN_SECONDS
    try:
        while size > 0:
            if time.monotonic() > deadline:
                return False
            got = rfile.read1(min(CHUNK, size)) if hasattr(rfile, "read1") else rfile.read(min(CHUNK, size))
            if not got:
                return False
            size -= len(got)
    except (OSError, ValueError, ReadDeadline):
        return False
    return True


class ReadDeadline(Exception):
    """A request's headers or body did not arrive in time (--header-timeout, --min-body-rate)."""

    def __init__(self, what: str, seconds: float, received: int):
        super().__init__(f"the request's {what} did not arrive within {seconds:g} s")
        self.what, self.seconds, self.received = what, seconds, received


class DeadlineReader(io.RawIOBase):
    """The connection's bytes, with one deadline over all the reads of a phase (`start`): each read waits
    at most until the deadline, and none starts after it. Between phases (`stop`), reads wait `idle`
    seconds each, the socket's timeout as before."""

    def __init__(self, sock, idle: float):
        self.sock, self.idle = sock, idle
        self.deadline: float | None = None
        self.what, self.seconds, self.received = "request", 0.0, 0

    def start(self, what: str, seconds: float) -> None:
        self.what, self.seconds, self.received = what, seconds, 0
        self.deadline = time.monotonic() + seconds

    def stop(self) -> None:
        self.deadline = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        wait = self.idle
        if self.deadline is not None:
            wait = min(wait, self.deadline - time.monotonic())
            if wait <= 0:
                raise ReadDeadline(self.what, self.seconds, self.received)
        self.sock.settimeout(wait)
        try:
            got = self.sock.recv_into(buffer)
        except TimeoutError:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise ReadDeadline(self.what, self.seconds, self.received) from None
            raise
        finally:
            self.sock.settimeout(self.idle)    # writes keep the connection's own timeout
        self.received += got
        return got


def body_seconds(size: int, limits) -> float:
    """The time a body of `size` bytes gets (ServerLimits): the header timeout, plus its size at the minimum rate."""
    return limits.header_timeout + size / limits.min_body_rate


def send_timeout(sock, exc: ReadDeadline, flag: str) -> None:
    """Answer 408 and let the connection close; written whole here, since the request line may be
    missing (nothing to take an HTTP version from). A client that does not read it costs 2 s at most."""
    body = json.dumps({"error": {"message": f"{str(exc)[0].upper()}{str(exc)[1:]} ({flag}).",
                                 "type": "invalid_request_error", "param": None, "code": "request_timeout"}})
    head = (f"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    try:
        sock.settimeout(2.0)
        sock.sendall(head.encode("ascii") + body.encode("utf-8"))
    except OSError:
        pass


def dropped_line(address, exc: BaseException) -> str:
    """The log line for a connection the client closed or reset, or one that timed out."""
    where = f"{address[0]}:{address[1]}" if isinstance(address, tuple) and len(address) >= 2 else str(address)
    if isinstance(exc, TimeoutError):
        return f"{where}: the connection timed out"
    return f"{where}: the client dropped the connection ({type(exc).__name__})"


def is_dropped(exc: BaseException | None) -> bool:
    """The client's side of the connection failed: not a fault of the server."""
    return isinstance(exc, (ConnectionError, TimeoutError))
