"""`mudpuppy serve`: OpenAI's chat completions API over one loaded model, standard library only.

    GET  /v1/models              the one model, as {"object": "list", "data": [...]}
    GET  /v1/models/NAME
    POST /v1/chat/completions    messages, temperature, top_p, top_k, max_tokens (max_completion_tokens),
                                 stop, seed, stream, stream_options.include_usage, n (1 only)

Requests are read by a thread each (ThreadingHTTPServer); generation runs one at a
time behind a lock, since one model serves them all. `stream: true` answers with
server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. A request
that is wrong gets OpenAI's error body, {"error": {"message", "type", "param", "code"}},
with the matching status, and the server goes on serving. Other fields OpenAI defines
(frequency_penalty, logprobs, user, ...) are accepted and ignored.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
import uuid
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..errors import MudpuppyError
from .engine import ChatModel, GenerationOptions

MAX_BODY = 16 * 2**20
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class ChatServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], model: ChatModel | None, defaults: GenerationOptions, log=None):
        self.model = model
        self.defaults = defaults
        self.lock = threading.Lock()      # one generation at a time
        self.created = int(time.time())
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        super().__init__(address, Handler)

    def model_card(self) -> dict:
        return {"id": self.model.name, "object": "model", "created": self.created, "owned_by": "mudpuppy"}


def start_server(model: ChatModel | None, host: str, port: int, defaults: GenerationOptions,
                 log=None) -> ChatServer:
    """The server bound to host:port (not serving yet). The CLI binds before the model loads, with
    `model` None, so that a port in use is reported at once rather than after the load."""
    try:
        return ChatServer((host, port), model, defaults, log)
    except OSError as exc:
        hint = " (--port 0 picks a free one)" if exc.errno in (98, 48) else ""
        raise MudpuppyError(f"--host {host} --port {port}: cannot listen there: {exc.strerror or exc}{hint}") from exc


def serve(model: ChatModel, host: str, port: int, defaults: GenerationOptions, echo=print,
          server: ChatServer | None = None) -> None:
    """Serve until Ctrl-C, then close the socket and return. `server`: one bound already by start_server."""
    if server is None:
        server = start_server(model, host, port, defaults)
    server.model = model
    shown = f"[{host}]" if ":" in host else host
    echo(f"serving {model.name} ({model.description}) at http://{shown}:{server.server_port}/v1")
    echo("  POST /v1/chat/completions, GET /v1/models; Ctrl-C stops")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        echo("stopped")
    finally:
        server.server_close()


# --------------------------------------------------------------------------- requests

def parse_chat_request(body: dict, served: str, defaults: GenerationOptions) -> tuple[list[dict], GenerationOptions,
                                                                                        bool, bool]:
    """(messages, options, stream, include_usage) from a /v1/chat/completions body, or a RequestError."""
    model = body.get("model")
    if model is not None and model != served:
        raise RequestError(404, f"The model `{model}` does not exist; this server serves `{served}`.", "model",
                           "model_not_found")
    messages = parse_messages(body.get("messages"))
    max_tokens = integer(body, "max_tokens", defaults.max_new_tokens, 1)
    options = replace(
        defaults,
        temperature=number(body, "temperature", defaults.temperature, 0.0, 2.0),
        top_p=number(body, "top_p", defaults.top_p, 0.0, 1.0, low_open=True),
        top_k=integer(body, "top_k", defaults.top_k, 0),
        max_new_tokens=integer(body, "max_completion_tokens", max_tokens, 1),
        seed=integer(body, "seed", defaults.seed, None),
        stop=parse_stop(body.get("stop")),
    )
    if body.get("n", 1) != 1:
        raise RequestError(400, "Only n=1 is supported.", "n", "unsupported_value")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(400, f"Invalid type for 'stream': expected a boolean, got {kind(stream)}.", "stream",
                           "invalid_type")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError(400, "Invalid type for 'stream_options': expected an object.", "stream_options",
                           "invalid_type")
    return messages, options, stream, bool(stream_options.get("include_usage"))


def parse_messages(value) -> list[dict]:
    if value is None:
        raise RequestError(400, "Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise RequestError(400, "'messages' must be a non-empty array of {role, content} objects.", "messages",
                           "invalid_type")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise RequestError(400, f"Invalid type for '{where}': expected an object.", where, "invalid_type")
        role = msg.get("role")
        if role not in ROLES:
            raise RequestError(400, f"Invalid value for '{where}.role': {role!r}; supported: "
                                    f"{', '.join(ROLES)}.", f"{where}.role", "invalid_value")
        out.append({"role": ROLES[role], "content": message_text(msg.get("content"), f"{where}.content")})
    return out


def message_text(content, where: str) -> str:
    """A string, or OpenAI's content parts of type text, joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"Invalid content part in '{where}': only text parts are supported.", where,
                                   "invalid_value")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(400, f"Invalid type for '{where}': expected a string or an array of text parts, got "
                            f"{kind(content)}.", where, "invalid_type")


def parse_stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and len(value) <= 4 and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise RequestError(400, "Invalid value for 'stop': expected a string or an array of up to 4 strings.", "stop",
                       "invalid_value")


def number(body: dict, key: str, default, low: float, high: float, low_open: bool = False):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(400, f"Invalid type for '{key}': expected a number, got {kind(value)}.", key, "invalid_type")
    if value > high or value < low or (low_open and value == low):
        span = f"{'above' if low_open else 'at least'} {low:g} and at most {high:g}"
        raise RequestError(400, f"Invalid value for '{key}': {value}; it must be {span}.", key, "invalid_value")
    return float(value)


def integer(body: dict, key: str, default, low: int | None):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"Invalid type for '{key}': expected an integer, got {kind(value)}.", key,
                           "invalid_type")
    if low is not None and value < low:
        raise RequestError(400, f"Invalid value for '{key}': {value}; it must be at least {low}.", key,
                           "invalid_value")
    return value


def kind(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), type(value).__name__)


# --------------------------------------------------------------------------- the handler

class Handler(BaseHTTPRequestHandler):
    server: ChatServer
    protocol_version = "HTTP/1.1"
    server_version = "mudpuppy"

    def log_message(self, format: str, *args) -> None:
        self.server.log(f"{self.address_string()} {format % args}")

    def do_GET(self) -> None:
        self.guard(self.get)

    def do_POST(self) -> None:
        self.guard(self.post)

    def guard(self, handler) -> None:
        """Every failure becomes an OpenAI error body; nothing a request does stops the server."""
        try:
            handler()
        except RequestError as exc:
            self.send_json(exc.status, exc.body())
        except MudpuppyError as exc:
            self.send_json(400, RequestError(400, str(exc)).body())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:   # a bug: say so, keep serving
            self.server.log(traceback.format_exc())
            self.send_json(500, RequestError(500, f"The server failed on this request: {type(exc).__name__}: {exc}",
                                             kind="server_error").body())

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
        body = self.read_json()
        messages, options, stream, include_usage = parse_chat_request(body, self.server.model.name,
                                                                      self.server.defaults)
        with self.server.lock:
            if stream:
                self.stream_completion(messages, options, include_usage)
            else:
                self.send_json(200, self.completion(messages, options))

    # ----------------------------------------------------------------- bodies
    def read_body_raw(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise RequestError(411, "A Content-Length header is required.", code="length_required")
        try:
            size = int(length)
        except ValueError:
            self.close_connection = True
            raise RequestError(400, f"Invalid Content-Length header: {length!r}.") from None
        if size < 0 or size > MAX_BODY:
            self.close_connection = True
            raise RequestError(413, f"The request body is {size} bytes; the limit is {MAX_BODY}.",
                               code="request_too_large")
        return self.rfile.read(size)

    def read_json(self) -> dict:
        raw = self.read_body_raw()
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RequestError(400, f"We could not parse the JSON body of your request ({exc}). The body must be "
                                    "a JSON object.", code="invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError(400, f"The request body must be a JSON object, got {kind(body)}.",
                               code="invalid_json")
        return body

    def send_json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    # ----------------------------------------------------------------- answers
    def completion(self, messages: list[dict], options: GenerationOptions) -> dict:
        done = self.server.model.complete(messages, options)
        return {
            "id": completion_id(), "object": "chat.completion", "created": int(time.time()),
            "model": self.server.model.name, "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text}, "logprobs": None,
                         "finish_reason": done.finish_reason}],
            "usage": usage(done),
        }

    def stream_completion(self, messages: list[dict], options: GenerationOptions, include_usage: bool) -> None:
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
        self.end_headers()
        self.close_connection = True
        self.send_event(chunk({"role": "assistant", "content": ""}))
        try:
            done = self.server.model.complete(messages, options,
                                              lambda text: self.send_event(chunk({"content": text})))
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as exc:   # the status is sent already: the error goes out as an event, as OpenAI's do
            if not isinstance(exc, MudpuppyError):
                self.server.log(traceback.format_exc())
            self.send_event(RequestError(500, f"Generation failed: {exc}", kind="server_error").body())
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


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}
