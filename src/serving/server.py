"""`mudpuppy serve`: OpenAI's chat completions API over one loaded model, standard library only.

    GET  /v1/models              the one model, as {"object": "list", "data": [...]}
    GET  /v1/models/NAME
    POST /v1/chat/completions    messages, temperature, top_p, top_k, max_tokens (max_completion_tokens),
                                 stop, seed, stream, stream_options.include_usage, n (1 only)

Connections are read by a thread each, at most --max-connections at once, the next ones answered
503 with Retry-After (connections.py); a body above --max-body is refused (413) before it is read.
Requests are checked (requests.py: fields and limits; security.py: API key, Origin, Host,
Content-Type); the model belongs to one scheduler thread that decodes every request's answer in
one batch (scheduler.py). `stream:
true` answers with server-sent events in OpenAI's chunk format, ending with `data: [DONE]`.
A request that is wrong gets OpenAI's error body, {"error": {"message", "type", "param",
"code"}}, with the matching status, and the server goes on serving. Other fields OpenAI
defines (frequency_penalty, logprobs, user, ...) are accepted and ignored.

Stopping (Ctrl-C, SIGTERM): no new connections; every answer in progress ends at once with
finish_reason "length" (a stream gets its last chunk and `data: [DONE]`); the scheduler
thread is joined, so nothing runs inside torch at exit; then the process exits 0.
"""

from __future__ import annotations

import io
import json
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..errors import MudpuppyError
from .connections import (BACKLOG, DRAIN_SECONDS, RETRY_AFTER, Admission, DeadlineReader, ReadDeadline,
                          body_seconds, discard, dropped_line, is_dropped, send_timeout)
from .engine import ChatModel, GenerationOptions
from .bounds import ContextExceeded, PromptBound
from .requests import RequestError, apply_limits, load_json, parse_chat_request
from .scheduler import ClientGone, GenerationFailed, Scheduler, Stopping, generate
from .security import Guard, is_loopback

GRACE = 10.0          # seconds answers in progress get to send their ending at shutdown


@dataclass(frozen=True)
class ServerLimits:
    max_tokens: int = 4096                 # the most a request may ask for (--max-tokens)
    request_timeout: float | None = 600.0  # seconds from arrival to the last token (--request-timeout; None: none)
    max_batch: int = 16                    # answers decoded together (--max-batch); more wait their turn
    api_key: str | None = None
    allow_origins: tuple[str, ...] = ()
    max_body: int = 4 * 2**20              # bytes in one request body (--max-body); above it, 413 unread
    max_connections: int = 128             # connections handled at once (--max-connections); more get a 503
    header_timeout: float = 10.0           # seconds for a request's line and headers (--header-timeout); then 408
    min_body_rate: float = 64 * 2**10      # bytes/s: a body gets header_timeout + size / this (--min-body-rate)


class ChatServer(ThreadingHTTPServer):
    daemon_threads = True                  # request threads never touch the model; the scheduler's is joined
    request_queue_size = BACKLOG           # listen backlog: Python's default of 5 resets clients under load

    def __init__(self, address: tuple[str, int], model: ChatModel | None, defaults: GenerationOptions, log=None,
                 limits: ServerLimits | None = None):
        self.defaults = defaults
        self.limits = limits or ServerLimits()
        self.created = int(time.time())
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.guard = Guard(self.limits.api_key, self.limits.allow_origins, is_loopback(address[0]))
        self.model: ChatModel | None = None
        self.scheduler: Scheduler | None = None
        self.context: int | None = None
        self.prompt_chars: int | None = None   # longer messages are refused before tokenizing
        self.busy = threading.Condition()   # guards `answering` and `connections`
        self.answering = 0                   # requests with an answer in progress
        self.connections: set[socket.socket] = set()
        self.stopping = False
        self.admission = Admission(self.limits.max_connections, self.process_request_thread, self.refuse,
                                   self.shutdown_request)
        super().__init__(address, Handler)      # a failed bind calls server_close, which stops the admission
        if model is not None:
            self.attach(model)

    def attach(self, model: ChatModel) -> None:
        """Serve `model`: its scheduler thread starts here."""
        self.model = model
        self.bound = PromptBound.of(model)
        self.context, self.prompt_chars = self.bound.context, self.bound.chars
        self.scheduler = Scheduler(model, self.limits.max_batch, self.log)

    def model_card(self) -> dict:
        return {"id": self.model.name, "object": "model", "created": self.created, "owned_by": "mudpuppy"}

    def stop_answers(self) -> None:
        """End every answer in progress and wait (GRACE at most) until each has been sent; close idle connections."""
        self.stopping = True
        if self.scheduler is not None:
            self.scheduler.stop()
        deadline = time.monotonic() + GRACE
        with self.busy:
            while self.answering and time.monotonic() < deadline:
                self.busy.wait(0.1)
            for conn in list(self.connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)     # a keep-alive connection waiting for its next request
                except OSError:
                    pass
            # ...and wait for their threads to log and leave: a daemon thread writing to stderr while
            # the interpreter exits is a fatal error (SIGABRT, "could not acquire lock for <stderr>")
            deadline = time.monotonic() + 2.0
            while self.connections and time.monotonic() < deadline:
                self.busy.wait(0.05)

    def server_close(self) -> None:
        self.stop_answers()
        self.admission.stop()
        super().server_close()

    # ----------------------------------------------------------------- connections
    def process_request(self, request, client_address) -> None:
        self.admission.admit(request, client_address)

    def refuse(self, request, client_address) -> None:
        """A connection beyond --max-connections: its request read and answered 503 (Overloaded)."""
        try:
            Overloaded(request, client_address, self)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        """A client that drops its connection is one line; anything else is a bug and keeps its traceback."""
        exc = sys.exc_info()[1]
        if is_dropped(exc):
            self.log(dropped_line(client_address, exc))
        else:
            self.log(f"{client_address[0]}:{client_address[1]}: the connection failed\n{traceback.format_exc()}")


def start_server(model: ChatModel | None, host: str, port: int, defaults: GenerationOptions,
                 log=None, limits: ServerLimits | None = None) -> ChatServer:
    """The server bound to host:port (not serving yet). The CLI binds before the model loads, with
    `model` None, so that a port in use is reported at once rather than after the load."""
    try:
        return ChatServer((host, port), model, defaults, log, limits)
    except OSError as exc:
        hint = " (--port 0 picks a free one)" if exc.errno in (98, 48) else ""
        raise MudpuppyError(f"--host {host} --port {port}: cannot listen there: {exc.strerror or exc}{hint}") from exc


def serve(model: ChatModel, host: str, port: int, defaults: GenerationOptions, echo=print,
          server: ChatServer | None = None, limits: ServerLimits | None = None) -> None:
    """Serve until Ctrl-C or SIGTERM, then stop as the module docstring says and return.
    `server`: one bound already by start_server."""
    if server is None:
        server = start_server(model, host, port, defaults, limits=limits)
    if server.model is None:
        server.attach(model)
    shown = f"[{host}]" if ":" in host else host
    if not is_loopback(host) and server.limits.api_key is None:
        print(f"warning: --host {host} opens this server to the network and it has no API key: anyone who can "
              "reach the port can use it. Set --api-key (or MUDPUPPY_API_KEY).", file=sys.stderr, flush=True)
    echo(f"serving {model.name} ({model.description}) at http://{shown}:{server.server_port}/v1")
    echo("  POST /v1/chat/completions, GET /v1/models; Ctrl-C stops")
    previous = install_stop_signals()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        echo("stopping: ending the answers in progress")
    finally:
        server.server_close()
        restore_signals(previous)
    echo("stopped")


def install_stop_signals() -> dict:
    """SIGINT and SIGTERM leave serve_forever (in the main thread) once; a second one waits for the first."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    fired = []

    def on_signal(signum, frame):
        if not fired:
            fired.append(signum)
            raise KeyboardInterrupt
        print("already stopping; the answers in progress are ending", file=sys.stderr, flush=True)

    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}


def restore_signals(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


# --------------------------------------------------------------------------- the handler

class Handler(BaseHTTPRequestHandler):
    server: ChatServer
    protocol_version = "HTTP/1.1"
    server_version = "mudpuppy"
    timeout = 120          # seconds one read may wait; each request's headers and body have a deadline besides
    drain_seconds, header_cap = DRAIN_SECONDS, float("inf")     # the body unread behind a refusal; headers

    def setup(self) -> None:
        super().setup()
        self.rfile.close()             # reads go through one deadline per part of a request instead
        self.reader = DeadlineReader(self.connection, self.timeout)
        self.rfile = io.BufferedReader(self.reader)
        self.served = False            # a request on this connection was read whole
        with self.server.busy:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        with self.server.busy:
            self.server.connections.discard(self.connection)
            self.server.busy.notify_all()

    def handle_one_request(self) -> None:
        self.reader.start("headers", min(self.header_cap, self.server.limits.header_timeout))
        try:
            super().handle_one_request()
        except ReadDeadline as exc:
            self.too_slow(exc)

    def too_slow(self, exc: ReadDeadline) -> None:
        """A 408 for a request that stopped coming; a connection that sent nothing is closed without one (a
        client would take it for the answer to the request it sends next), logged unless it is keep-alive."""
        self.close_connection = True
        where = f"{self.client_address[0]}:{self.client_address[1]}"
        if exc.what == "headers" and exc.received == 0:
            if not self.served:
                self.server.log(f"{where}: sent no request within {exc.seconds:g} s (--header-timeout); closed")
            return
        flag = "--header-timeout" if exc.what == "headers" else "--header-timeout, --min-body-rate"
        self.server.log(f"{where}: {exc} ({flag}); answered 408")
        send_timeout(self.connection, exc, flag)

    def log_message(self, format: str, *args) -> None:
        self.server.log(f"{self.address_string()} {format % args}")

    def do_GET(self) -> None:
        self.guard(self.get)

    def do_POST(self) -> None:
        self.guard(self.post)

    def do_OPTIONS(self) -> None:
        """A browser's preflight: answered for origins --allow-origin lets in (the guard refuses others)."""
        self.guard(self.preflight)

    def guard(self, handler) -> None:
        """Every failure becomes an OpenAI error body; nothing a request does stops the server."""
        self.body_read = self.in_answer = False
        self.served = True
        try:
            self.server.guard.check(self.command, self.headers)
            handler()
        except RequestError as exc:
            self.refuse(exc)
        except MudpuppyError as exc:
            self.refuse(RequestError(400, str(exc)))
        except ClientGone:                        # it left during its answer: the scheduler logs that
            self.close_connection = True
        except (ConnectionError, TimeoutError) as exc:    # it left, or its body stopped coming
            self.close_connection = True
            if not self.in_answer:
                self.server.log(dropped_line(self.client_address, exc))
        except ReadDeadline:
            raise                                 # handle_one_request answers it: 408
        except Exception as exc:   # a bug: say so, keep serving
            self.server.log(traceback.format_exc())
            self.refuse(RequestError(500, f"The server failed on this request: {type(exc).__name__}: {exc}",
                                     kind="server_error"))

    def refuse(self, exc: RequestError) -> None:
        """Answer with the error; a body left unread is read and dropped after it, so that closing the
        connection does not reset the client before it reads the answer (connections.discard)."""
        unread = not self.body_read and self.command not in ("GET", "HEAD", "OPTIONS")
        if unread:
            self.close_connection = True
        self.send_json(exc.status, exc.body())
        size = self.declared_length() if unread else None
        if size:
            self.wfile.flush()
            self.reader.start("body", self.drain_seconds)
            discard(self.rfile, size)

    def preflight(self) -> None:
        self.send_response(204)
        self.cors_headers()
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type")
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def get(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [self.server.model_card()]})
        elif path.startswith("/v1/models/"):
            name = path.removeprefix("/v1/models/")
            if name != self.server.model.name:
                raise RequestError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
            self.send_json(200, self.server.model_card())
        elif path == "/v1/chat/completions":
            raise RequestError(405, "Use POST for /v1/chat/completions.", code="method_not_allowed")
        else:
            raise RequestError(404, f"Unknown request URL: GET {self.path}.", code="unknown_url")

    def post(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path != "/v1/chat/completions":
            self.read_body_raw()       # leave the connection clean for the next request
            raise RequestError(404, f"Unknown request URL: POST {self.path}.", code="unknown_url")
        server = self.server
        request = parse_chat_request(load_json(self.read_body_raw()), server.model.name, server.defaults)
        try:
            prompt = server.bound.prompt_ids(server.model, request.messages)
        except ContextExceeded as exc:
            raise RequestError(400, f"{exc} Please reduce the length of the messages.", "messages",
                               "context_length_exceeded") from None
        options = apply_limits(request, len(prompt), server.context, server.limits.max_tokens)
        if server.stopping:
            raise RequestError(503, "The server is shutting down.", kind="server_error", code="shutting_down")
        with server.busy:
            server.answering += 1
        self.in_answer = True           # from here, a client that leaves is logged by the scheduler
        try:
            if request.stream:
                self.stream_completion(prompt, options, request.include_usage)
            else:
                self.send_json(200, self.completion(prompt, options))
        finally:
            with server.busy:
                server.answering -= 1
                server.busy.notify_all()

    # ----------------------------------------------------------------- bodies
    def declared_length(self) -> int | None:
        """The body's size by its one Content-Length header: ASCII digits only (int() would take "+5",
        " 5", "5_0"); None when it is missing, repeated, malformed, or the body is chunked."""
        values = self.headers.get_all("Content-Length") or []
        if len(values) != 1 or self.headers.get("Transfer-Encoding") is not None:
            return None
        value = values[0].strip()
        return int(value) if re.fullmatch(r"[0-9]{1,19}", value) else None

    def read_body_raw(self) -> bytes:
        size = self.declared_length()
        if size is None:
            if self.headers.get("Content-Length") is None:
                raise RequestError(411, "A Content-Length header is required (chunked bodies are not read).",
                                   code="length_required")
            shown = ", ".join(repr(v) for v in self.headers.get_all("Content-Length"))
            raise RequestError(400, f"Invalid Content-Length header: {shown}.", code="invalid_content_length")
        limit = self.server.limits.max_body
        if size > limit:
            raise RequestError(413, f"The request body is {size} bytes; this server reads at most {limit} "
                                    "(--max-body).", code="request_too_large")
        self.reader.start("body", body_seconds(size, self.server.limits))
        body = self.rfile.read(size)
        self.body_read = True
        return body

    def send_json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if status == 503:
            self.send_header("Retry-After", str(RETRY_AFTER))
        self.cors_headers()
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def cors_headers(self) -> None:
        origin = self.server.guard.cors_origin(self.headers)
        if origin is not None:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")

    # ----------------------------------------------------------------- answers
    def generate(self, prompt: list[int], options: GenerationOptions, on_text=None):
        try:
            return generate(self.server.scheduler, prompt, options, self.server.limits.request_timeout, on_text,
                            self.client_gone)
        except Stopping:
            raise RequestError(503, "The server is shutting down.", kind="server_error",
                               code="shutting_down") from None

    def client_gone(self) -> bool:
        """The client closed its end (a read would return nothing): its answer is not wanted any more."""
        if self.server.stopping:
            return False        # shutdown ends every answer itself, and sends each its ending
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def completion(self, prompt: list[int], options: GenerationOptions) -> dict:
        try:
            done = self.generate(prompt, options)
        except GenerationFailed as exc:
            raise RequestError(500, f"Generation failed: {exc}", kind="server_error") from None
        return {
            "id": completion_id(), "object": "chat.completion", "created": int(time.time()),
            "model": self.server.model.name, "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text}, "logprobs": None,
                         "finish_reason": done.finish_reason}],
            "usage": usage(done),
        }

    def stream_completion(self, prompt: list[int], options: GenerationOptions, include_usage: bool) -> None:
        ident, created, name = completion_id(), int(time.time()), self.server.model.name

        def chunk(delta: dict, finish: str | None = None) -> dict:
            out = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": name,
                   "system_fingerprint": None,
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
            if include_usage:
                out["usage"] = None
            return out

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")    # the body ends when the connection does
        self.cors_headers()
        self.end_headers()
        self.close_connection = True
        self.send_event(chunk({"role": "assistant", "content": ""}))
        try:
            done = self.generate(prompt, options, lambda text: self.send_event(chunk({"content": text})))
        except (GenerationFailed, RequestError) as exc:   # the status is sent already: the error is an event
            message = exc.message if isinstance(exc, RequestError) else f"Generation failed: {exc}"
            self.send_event(RequestError(500, message, kind="server_error").body())
            self.wfile.write(b"data: [DONE]\n\n")
            return
        self.send_event(chunk({}, done.finish_reason))
        if include_usage:
            self.send_event({"id": ident, "object": "chat.completion.chunk", "created": created, "model": name,
                             "system_fingerprint": None, "choices": [], "usage": usage(done)})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def send_event(self, payload: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode("utf-8") + b"\n\n")
        self.wfile.flush()


class Overloaded(Handler):
    """The answer to a connection beyond --max-connections: its request read, a 503 with Retry-After."""
    timeout = 2            # one thread answers these, one at a time: a slow client must not hold it
    drain_seconds = header_cap = 2.0

    def do_GET(self) -> None:
        self.guard(self.overloaded)

    do_POST = do_OPTIONS = do_GET

    def overloaded(self) -> None:
        self.close_connection = True       # one answer, then the overflow thread takes the next connection
        limit = self.server.limits.max_connections
        raise RequestError(503, f"The server is handling {limit} connections, its limit (--max-connections); "
                                f"retry after {RETRY_AFTER} s.", kind="server_error", code="overloaded")


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}
