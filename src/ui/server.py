"""`mudpuppy ui`'s HTTP server: the page, its JSON API and the live feed, standard library only.

    GET  /                      the page (static/index.html; app.js and style.css under /static/)
    GET  /api/runs              every run under the folder (runs.py)
    GET  /api/run?name=RUN      one run: its row, config.yaml, the log the page keeps of it
    GET  /api/events?name=RUN   server-sent events: `metrics` (new metrics.jsonl lines), `reset` (the file was
                                cut back, as a resume does), `status`, `log` (new log text)
    GET  /api/file?path=P       a text or PNG file inside the folder (a run's README.md, loss.png)
    GET  /api/configs           the YAML files under the folder a run may start from
    POST /api/validate          the form checked as `mudpuppy validate` / `mudpuppy train` check it
    POST /api/start | /api/stop | /api/resume     jobs.py
    POST /api/chat              one answer of a finished run (or its base), streamed as server-sent events (talk.py)
    POST /api/export | /api/eval    `mudpuppy export` / `mudpuppy eval` as child processes (ship.py)
    GET  /api/task?id=ID        such a task: its output so far, its exit code, the export's path or the eval's table
    GET  /api/choices           export formats and quantizations, the data files an evaluation may read

Who may talk to it is serving/security.py's Guard, as for `mudpuppy serve`: bound to loopback, a Host header
must name a loopback host (DNS rebinding); an Origin other than the page's own is refused; a POST must be
application/json; with --token every request carries it (`Authorization: Bearer TOKEN`, or the cookie the
page gets by opening /?token=TOKEN once). Beyond loopback the server does not start without a token. Every
path the page names is resolved inside the folder (runs.inside): nothing outside it is read or written.
"""

from __future__ import annotations

import hmac
import json
import mimetypes
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from ..errors import MudpuppyError
from ..serving.requests import RequestError
from ..serving.security import Guard, is_loopback
from . import runs
from .extras import Hardware, samples
from .jobs import Jobs
from .ship import Tasks, data_files, export_choices
from .talk import Talk

STATIC = Path(__file__).parent / "static"
STATIC_FILES = {"index.html", "app.js", "style.css", "charts.js", "talk.js"}
COOKIE = "mudpuppy_ui_token"
POLL = 0.2                       # seconds between looks at metrics.jsonl for the live feed
MAX_BODY = 1 << 20
FILE_TYPES = {".md": "text/plain; charset=utf-8", ".txt": "text/plain; charset=utf-8",
              ".json": "application/json", ".jsonl": "text/plain; charset=utf-8", ".yaml": "text/plain; charset=utf-8",
              ".yml": "text/plain; charset=utf-8", ".log": "text/plain; charset=utf-8", ".png": "image/png"}


class UIServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], root: Path, token: str | None = None, python: str | None = None):
        if not is_loopback(address[0]) and not token:
            raise MudpuppyError(f"--host {address[0]} opens the page to the network: give it a --token (or "
                                "MUDPUPPY_UI_TOKEN), as `mudpuppy serve` needs --api-key there")
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise MudpuppyError(f"RUNS_DIR {root}: not a folder")
        self.token = token
        self.guard = Guard(token, (), is_loopback(address[0]))
        self.jobs = Jobs(self.root, **({"python": python} if python else {}))
        self.tasks = Tasks(self.root, **({"python": python} if python else {}))
        self.talk = Talk(self.root)
        self.hardware = Hardware()
        self.stopping = False
        try:
            super().__init__(address, Handler)
        except OSError as exc:
            raise MudpuppyError(f"--host {address[0]} --port {address[1]}: cannot listen there ({exc.strerror}); "
                                "choose another --port (0: any free one)") from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/"

    def runs(self) -> list[dict]:
        found = runs.find_runs(self.root)
        starting = [self.root / name for name in self.jobs.started() if self.root / name not in found]
        return [self.describe(folder) for folder in found + starting]

    def describe(self, folder: Path) -> dict:
        name = runs.relative_name(self.root, folder)
        info = runs.describe(self.root, folder, self.jobs.record(name)).as_dict()
        seen = self.jobs.device(name)
        if seen is not None:
            info["backend"], info["device"] = seen
        return info


class _Headers(dict):
    """The request's headers, with the page's cookie standing in for an Authorization header."""

    def get(self, key, default=None):
        return super().get(key.lower(), default)


class Handler(BaseHTTPRequestHandler):
    server: UIServer
    server_version = "mudpuppy-ui"

    def log_message(self, fmt, *args):       # the terminal keeps mudpuppy's own lines
        pass

    # ------------------------------------------------------------------ dispatch
    def do_GET(self):
        self._serve("GET")

    def do_POST(self):
        self._serve("POST")

    def _serve(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            if method == "GET" and url.path == "/" and "token" in query:
                return self._take_token(query["token"])
            self.server.guard.check(method, self._headers())
            route = ROUTES.get((method, url.path))
            if route is None and method == "GET" and url.path.startswith("/static/"):
                return self._static(url.path[len("/static/"):])
            if route is None:
                raise RequestError(404, f"{method} {url.path}: no such page", code="not_found")
            if method == "POST":
                return route(self, self._body())
            return route(self, query)
        except RequestError as exc:
            self._json({"error": exc.message, "code": exc.code}, exc.status)
        except runs.OutsideFolder as exc:
            self._json({"error": str(exc), "code": "outside_folder"}, 403)
        except MudpuppyError as exc:
            self._json({"ok": False, "error": f"error: {exc}"}, 400)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _headers(self) -> _Headers:
        headers = _Headers((k.lower(), v) for k, v in self.headers.items())
        if "authorization" not in headers:
            for part in (self.headers.get("Cookie") or "").split(";"):
                key, _, value = part.strip().partition("=")
                if key == COOKIE and value:
                    headers["authorization"] = f"Bearer {value}"
        return headers

    def _take_token(self, given: str) -> None:
        """/?token=T: the token checked once, then kept by the browser as an HttpOnly, same-site cookie."""
        token = self.server.token
        if token is None or not hmac.compare_digest(given.encode(), token.encode()):
            raise RequestError(401, "Incorrect token: open the address `mudpuppy ui` printed.", code="invalid_token")
        headers = self._headers()
        headers["authorization"] = f"Bearer {token}"
        self.server.guard.check("GET", headers)         # Host and Origin, as for every request
        self.send_response(303)
        self.send_header("Location", "/")
        self.send_header("Set-Cookie", f"{COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise RequestError(413, f"request body of {length} bytes: the most is {MAX_BODY}", code="too_large")
        try:
            data = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            raise RequestError(400, "the body is not JSON", code="invalid_json") from None
        if not isinstance(data, dict):
            raise RequestError(400, "the body must be a JSON object", code="invalid_json")
        return data

    # ------------------------------------------------------------------ answers
    def _send(self, body: bytes, kind: str, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Frame-Options", "DENY")
        self.send_header("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, data, status: int = 200) -> None:
        self._send(json.dumps(data).encode(), "application/json", status)

    def _static(self, name: str) -> None:
        if name not in STATIC_FILES:
            raise RequestError(404, f"/static/{name}: no such file", code="not_found")
        kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
        self._send((STATIC / name).read_bytes(), f"{kind}; charset=utf-8")

    def index(self, _query) -> None:
        self._send((STATIC / "index.html").read_bytes(), "text/html; charset=utf-8")

    def list_runs(self, _query) -> None:
        self._json({"root": str(self.server.root), "runs": self.server.runs()})

    def run_page(self, query) -> None:
        folder = self._run(query)
        name = runs.relative_name(self.server.root, folder)
        config = folder / "config.yaml"
        metrics, _ = runs.read_metrics(folder)
        self._json({"run": self.server.describe(folder),
                    "config": config.read_text(encoding="utf-8", errors="replace") if config.is_file() else "",
                    **_tail(self.server.jobs.log_path(name)), "metrics": metrics,
                    "hardware": self.server.hardware.describe(folder), "samples": samples(folder),
                    "exports": self.server.tasks.of_run(name), "talk": self.server.talk.held()})

    def file(self, query) -> None:
        path = runs.inside(self.server.root, query.get("path", ""))
        kind = FILE_TYPES.get(path.suffix.lower())
        if kind is None or not path.is_file():
            raise RequestError(404, f"{query.get('path')!r}: no such text or PNG file in the runs folder",
                               code="not_found")
        self._send(path.read_bytes(), kind)

    def configs(self, _query) -> None:
        self._json({"configs": self.server.jobs.configs()})

    def validate(self, form: dict) -> None:
        from .jobs import check

        self._json(check(self.server.root, form))

    def start(self, form: dict) -> None:
        self._json({"ok": True, "job": self.server.jobs.start(form)})

    def stop(self, body: dict) -> None:
        self._json({"ok": True, **self.server.jobs.stop(str(body.get("run") or ""))})

    def resume(self, body: dict) -> None:
        self._json({"ok": True, "job": self.server.jobs.resume(str(body.get("run") or ""))})

    def chat(self, body: dict) -> None:
        """One answer, streamed: `note` (loading, freeing), `text` (each piece as it is generated), then
        `done` (token counts and times) or `error` (the message `mudpuppy chat` would print)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        try:
            stats = self.server.talk.reply(str(body.get("run") or ""), str(body.get("side") or "run"), body,
                                           lambda note: self._event("note", note), lambda text: self._event("text", text))
            self._event("done", stats)
        except (BrokenPipeError, ConnectionResetError):
            raise
        except MudpuppyError as exc:
            self._event("error", f"error: {exc}")
        except runs.OutsideFolder as exc:
            self._event("error", f"error: {exc}")
        except Exception as exc:          # noqa: BLE001 - the page shows what went wrong; the server goes on
            self._event("error", f"error: {type(exc).__name__}: {exc}")

    def export(self, body: dict) -> None:
        self._json({"ok": True, "task": self.server.tasks.export(body)})

    def evaluate(self, body: dict) -> None:
        self._json({"ok": True, "task": self.server.tasks.evaluate(body)})

    def task(self, query) -> None:
        self._json(self.server.tasks.get(query.get("id", "")))

    def choices(self, _query) -> None:
        self._json({**export_choices(), "data": data_files(self.server.root)})

    def events(self, query) -> None:
        """The live feed of one run: every metrics.jsonl line as it lands, its status and its log."""
        folder = self._run(query)
        name = runs.relative_name(self.server.root, folder)
        log_path = self.server.jobs.log_path(name)
        offset = int(query.get("from", 0) or 0)
        # Where the page's copy of the log ends (/api/run's log_size), so nothing written in between is lost.
        log_from = query.get("log_from", "")
        log_offset = int(log_from) if log_from.isdigit() else _size(log_path)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        status, shown, beat = None, None, 0.0
        while not self.server.stopping:
            size = runs.metrics_size(folder)
            if size < offset:                  # cut back (a resume drops the lines after its checkpoint)
                offset = 0
                self._event("reset", {})
            rows, offset = runs.read_metrics(folder, offset)
            if rows:
                self._event("metrics", rows)
            now = time.monotonic()
            if now - beat >= 1.0:
                beat = now
                info = self.server.describe(folder)
                if info != status:
                    status = info
                    self._event("status", info)
                else:
                    self.wfile.write(b": beat\n\n")
                    self.wfile.flush()
                extras = {"hardware": self.server.hardware.describe(folder), "samples": samples(folder)}
                if extras != shown:
                    shown = extras
                    self._event("extras", extras)
            # The log on every poll, as the metrics: a line printed before a step ("resumed from ...")
            # reaches the page no later than that step's point.
            grown = _size(log_path)
            if grown < log_offset:             # a log that is not the one the page read: all of it
                log_offset = 0
            if grown > log_offset:
                with log_path.open("rb") as fh:
                    fh.seek(log_offset)
                    self._event("log", fh.read(grown - log_offset).decode("utf-8", "replace"))
                log_offset = grown
            time.sleep(POLL)

    def _event(self, kind: str, data) -> None:
        self.wfile.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()

    def _run(self, query) -> Path:
        folder = runs.inside(self.server.root, query.get("name", ""))
        name = runs.relative_name(self.server.root, folder)
        if not runs.is_run(folder) and self.server.jobs.record(name) is None:   # started here, not yet begun
            raise RequestError(404, f"{query.get('name')!r}: no run there", code="not_found")
        return folder


ROUTES = {("GET", "/"): Handler.index, ("GET", "/api/runs"): Handler.list_runs,
          ("GET", "/api/run"): Handler.run_page, ("GET", "/api/events"): Handler.events,
          ("GET", "/api/file"): Handler.file, ("GET", "/api/configs"): Handler.configs,
          ("POST", "/api/validate"): Handler.validate, ("POST", "/api/start"): Handler.start,
          ("POST", "/api/stop"): Handler.stop, ("POST", "/api/resume"): Handler.resume,
          ("POST", "/api/chat"): Handler.chat, ("POST", "/api/export"): Handler.export,
          ("POST", "/api/eval"): Handler.evaluate, ("GET", "/api/task"): Handler.task,
          ("GET", "/api/choices"): Handler.choices}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _tail(path: Path, limit: int = 64 * 1024) -> dict:
    """{"log": the last `limit` bytes of the log, "log_size": the offset where what was read ends}."""
    size = _size(path)
    if not size:
        return {"log": "", "log_size": 0}
    with path.open("rb") as fh:
        fh.seek(max(0, size - limit))
        text = fh.read(size - max(0, size - limit))
    return {"log": text.decode("utf-8", "replace"), "log_size": size}
