"""The --tui dashboard on a terminal while a run trains, and the plain lines it falls back to.

    with watch_run(cfg.logging.tui) as echo:      # cli/runs.py: around creating the backend and the run
        run(cfg, backend, echo=echo)              # training.run names the run and its backend (note_run);
                                                  # the loop's standard callbacks draw on echo's dashboard

`watch_run` yields a `RunEcho`: the echo a run prints its lines with, carrying
the dashboard those lines go to, so whatever holds the echo reaches the
dashboard through it (`progress_display` builds the loop's callback from it).
While it is live, what the run echoes, prints or warns goes to the dashboard's
log panel instead of tearing the display (stdout, stderr, `warnings` and
the logging module's console handlers are redirected, and restored after).
It draws for rank 0 only. It never stops a run: off a terminal it does not
start (one warning, then the plain progress lines of monitor/progress.py), and
if drawing fails mid-run it stops, says so once, replays the log it was
holding and hands over to those plain lines.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import click

from .callbacks import Callback
from .progress import ProgressLines, plain_progress, postfix

HARDWARE_EVERY_S = 2.0          # device readings are cheap, but rocm-smi (the ROCm fallback) is a process per call


class RunEcho:
    """What watch_run yields: the `echo` a run prints its lines with (click.echo's arguments), and the
    dashboard those lines go to while one draws (None without --tui, off a terminal, or on ranks other than 0)."""

    def __init__(self, dashboard: "Dashboard | None" = None):
        self.dashboard = dashboard

    def __call__(self, message=None, err: bool = False, nl: bool = True, **kwargs) -> None:
        if self.dashboard is None:
            click.echo(message, err=err, nl=nl, **kwargs)
        else:
            self.dashboard.echo(message, err=err, nl=nl, **kwargs)


def drawing(echo) -> "Dashboard | None":
    """The dashboard drawing for `echo` right now, if any (an echo not from watch_run has none)."""
    dash = echo.dashboard if isinstance(echo, RunEcho) else None
    return dash if dash is not None and dash.live is not None else None


def note_run(cfg, backend, echo) -> None:
    """Name the run in the dashboard's header (each stage of a curriculum calls it again): the dashboard drawing
    for `echo`, if any."""
    dash = drawing(echo)
    if dash is not None:
        dash.describe(cfg, backend)


def progress_display(logging_cfg, echo) -> Callback:
    """The loop's progress callback: the dashboard drawing for `echo`, else the progress lines of
    `logging.progress_bar` / `logging.progress_every`."""
    enabled, every = logging_cfg.progress_bar, logging_cfg.progress_every
    dash = drawing(echo)
    if dash is None:
        return ProgressLines(enabled, every)
    return DashboardCallback(dash, enabled, every)


@contextmanager
def watch_run(enabled: bool, console=None, refresh_per_second: float = 4.0) -> Iterator[RunEcho]:
    """Show the dashboard while the body runs; yields the `echo` the run should print its lines with."""
    from ..distributed import from_environment

    if not enabled or not from_environment().is_main:         # other ranks stay quiet, as without --tui
        yield RunEcho()
        return
    dash = start_dashboard(console, refresh_per_second)
    if dash is None:
        yield RunEcho()
        return
    try:
        yield RunEcho(dash)
    except BaseException:
        dash.stop("stopped")             # the error itself is reported below the last frame
        raise
    dash.stop("finished")


def start_dashboard(console, refresh_per_second: float) -> "Dashboard | None":
    """A live dashboard, or None after one warning saying why there is none."""
    reason = terminal_problem() if console is None else ("" if console.is_terminal else "the console is no terminal")
    if not reason:
        dash = Dashboard(console, refresh_per_second)
        try:
            dash.start()
            return dash
        except Exception as exc:        # noqa: BLE001 - a dashboard that cannot start must not stop the run
            stop_quietly(dash.abandon())
            reason = f"it could not start ({type(exc).__name__}: {exc})"
    click.echo(f"warning: --tui: {reason}; showing plain progress lines instead", err=True)
    return None


def terminal_problem() -> str:
    if importlib.util.find_spec("rich") is None:
        return "the dashboard needs rich (pip install 'mudpuppy[tui]')"
    for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        if not (hasattr(stream, "isatty") and stream.isatty()):
            return f"{name} is not a terminal"
    if os.environ.get("TERM") == "dumb":
        return "the terminal cannot move its cursor (TERM=dumb)"
    return ""


class Dashboard:
    """The live display: a DashboardState, a rich Live drawing it, and a thread that keeps the clock ticking."""

    def __init__(self, console=None, refresh_per_second: float = 4.0):
        from .dashboard import DashboardState

        self.console = console
        self.state = DashboardState()
        self.lock = threading.RLock()
        self.started = time.perf_counter()
        self.interval = 1.0 / refresh_per_second
        self.backend = None
        self.live = None
        self.error: BaseException | None = None         # what broke the display, from whichever thread saw it
        self.last_frame = float("-inf")
        self.last_hardware = float("-inf")
        self.stopping = threading.Event()
        self.ticker: threading.Thread | None = None
        self.redirect: Redirect | None = None

    def now(self) -> float:
        return time.perf_counter() - self.started

    # -- lifecycle
    def start(self) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = self.console or Console(file=sys.stdout)      # the real terminal, kept past the redirect
        self.read_hardware()
        self.live = Live(console=self.console, get_renderable=self.frame, auto_refresh=False, transient=False,
                         redirect_stdout=False, redirect_stderr=False, vertical_overflow="crop")
        self.live.start(refresh=True)
        self.redirect = Redirect(self.add_line)
        self.ticker = threading.Thread(target=self.tick, name="mudpuppy-tui", daemon=True)
        self.ticker.start()

    def stop(self, outcome: str | None = None) -> None:
        """The run is over (`outcome`: finished or stopped), or drawing failed: leave the last frame on the
        terminal and give the streams back; after a failure, warn once and print the lines the log panel held."""
        if outcome is not None:
            with self.lock:
                self.state.phase = outcome
        live = self.abandon()
        if live is not None:
            self.error = stop_quietly(live) or self.error      # stopping draws the final frame
        if self.error is not None:
            error, self.error = self.error, None
            click.echo(f"warning: the --tui dashboard failed ({type(error).__name__}: {error}); the run goes on "
                       "with plain progress lines", err=True)
            with self.lock:
                lines = list(self.state.log)
            for line in lines:
                click.echo(line.text, err=line.warning)

    def abandon(self):
        """Stop drawing and give the streams back; returns the Live that was drawing, if any."""
        live, self.live = self.live, None
        self.stopping.set()
        if self.ticker is not None and self.ticker is not threading.current_thread():
            self.ticker.join(timeout=5)
        if self.redirect is not None:
            self.redirect.restore()
            self.redirect = None
        return live

    # -- drawing
    def frame(self):
        """What rich draws; runs in whichever thread refreshes. A failure is recorded, never raised here."""
        from rich.text import Text

        from . import dashboard

        try:
            with self.lock:
                width, height = self.console.size
                return dashboard.render(self.state, width, height, self.now())
        except Exception as exc:         # noqa: BLE001 - the main thread sees self.error and falls back
            self.error = self.error or exc
            return Text("")

    def refresh(self) -> None:
        """Draw a frame, at most one per refresh interval whichever thread asks."""
        live = self.live
        if live is None or self.error is not None or self.now() - self.last_frame < self.interval:
            return
        self.last_frame = self.now()
        try:
            live.refresh()
        except Exception as exc:         # noqa: BLE001 - e.g. the terminal went away
            self.error = self.error or exc

    def tick(self) -> None:
        """Between the run's own calls (loading, a long step): keep the clock and the readings current."""
        while not self.stopping.wait(self.interval):
            try:
                if time.perf_counter() - self.last_hardware >= HARDWARE_EVERY_S:
                    self.read_hardware()
                self.refresh()
            except Exception as exc:     # noqa: BLE001 - a thread's exception would vanish; the main thread reports it
                self.error = self.error or exc
                return

    def read_hardware(self) -> None:
        from ..backends.hardware import read_hardware

        self.last_hardware = time.perf_counter()
        try:
            readings = read_hardware(self.backend)
        except Exception as exc:         # noqa: BLE001 - readings are optional; a broken one must not end the run
            self.add_line(f"warning: no device readings ({type(exc).__name__}: {exc}); showing the process's only",
                          warning=True)
            self.backend = None          # from now on the readings every backend has
            readings = read_hardware(None)
        with self.lock:
            self.state.hardware = readings

    # -- what the run calls
    def guarded(self, action: Callable[[], None]) -> bool:
        """Apply `action` to the state and redraw; False when the dashboard is not (or no longer) drawing,
        in which case the caller prints plainly instead."""
        if self.live is not None and self.error is None:
            try:
                with self.lock:
                    action()
                self.refresh()
            except Exception as exc:     # noqa: BLE001 - falls back below
                self.error = exc
        if self.error is not None:
            self.stop()
            return False
        return self.live is not None

    def echo(self, message=None, err: bool = False, nl: bool = True, **kwargs) -> None:
        text = "" if message is None else str(message)
        if not self.guarded(lambda: self.add_lines(text)):
            click.echo(message, err=err, nl=nl, **kwargs)

    def add_lines(self, text: str) -> None:
        for line in text.splitlines():
            self.add_line(line)

    def add_line(self, line: str, warning: bool | None = None) -> None:
        if not line.strip():
            return
        with self.lock:
            self.state.add_log(line.rstrip(), looks_like_warning(line) if warning is None else warning)

    def describe(self, cfg, backend) -> None:
        def name_it():
            self.backend = backend
            method = cfg.method if cfg.data_method() == cfg.method else f"{cfg.method} ({cfg.data_method()})"
            self.state.header = {"model": Path(str(cfg.model.base_model)).name or str(cfg.model.base_model),
                                 "method": method, "adapter": cfg.adapter.type,
                                 "backend": f"{backend.name} on {backend.device}", "output": str(cfg.output_dir)}
            self.last_hardware = float("-inf")          # the device's readings from the next tick on

        self.guarded(name_it)

    def observe(self, record: dict) -> None:
        self.guarded(lambda: self.state.observe(record, at=self.now()))


class DashboardCallback(Callback):
    """The loop's callback while the dashboard draws: progress, metrics lines and samples go to the dashboard;
    after a drawing failure, plain progress lines carry on from the step reached (`enabled`: whether
    logging.progress_bar asks for them, `every`: logging.progress_every)."""

    def __init__(self, dash: Dashboard, enabled: bool, every: int | None):
        self.dash, self.enabled, self.every = dash, enabled, every
        self.total = self.n = 0
        self.plain = None
        self.fell_back = False

    def on_run_start(self, total: int, done: int) -> None:
        self.total, self.n = total, done
        self.dash.guarded(lambda: self.dash.state.begin(total, done, self.dash.now()))

    def on_samples(self, step: int, samples: list[dict]) -> None:
        if samples:
            self.dash.guarded(lambda: setattr(self.dash.state, "samples", list(samples)))

    def on_log(self, record: dict) -> None:
        self.dash.observe(dict(record))

    def on_step_end(self, step: int, metrics: dict) -> None:
        shown = postfix(metrics)
        self.n += 1
        if self.dash.guarded(lambda: self.dash.state.advance(self.n, self.dash.now())):
            return
        if not self.fell_back:
            self.fell_back = True
            # sys.stderr read now: the dashboard has stopped and given the real stream back
            self.plain = plain_progress(self.total, self.n - 1, self.every, sys.stderr) if self.enabled else None
        if self.plain is not None:
            self.plain.set_postfix(**shown)
            self.plain.update(1)

    def on_run_end(self) -> None:
        self.dash.guarded(lambda: setattr(self.dash.state, "phase", "finishing"))
        if self.plain is not None:
            self.plain.close()


def stop_quietly(live) -> BaseException | None:
    """Stop a rich Live; what that raised, if anything (the terminal may be gone by then)."""
    if live is None:
        return None
    try:
        live.stop()
    except Exception as exc:             # noqa: BLE001 - reported by the caller, never raised into the run
        return exc
    return None


def looks_like_warning(line: str) -> bool:
    lowered = line.lower()
    return "warning" in lowered or lowered.startswith(("error", "traceback"))


class Redirect:
    """While the dashboard draws, what would go to the terminal goes to its log panel: sys.stdout and
    sys.stderr, `warnings`, and the logging module's handlers that write to the console."""

    def __init__(self, sink: Callable[..., None]):
        self.saved = (sys.stdout, sys.stderr, warnings.showwarning)
        self.out, self.err = LineSink(sink), LineSink(sink)
        sys.stdout, sys.stderr = self.out, self.err
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sink(
            f"warning: {category.__name__}: {message} ({Path(filename).name}:{lineno})", warning=True)
        self.handlers = [(h, h.setStream(self.err)) for h in console_handlers(self.saved[:2])]

    def restore(self) -> None:
        for handler, stream in self.handlers:
            handler.setStream(stream)
        self.out.close_line()
        self.err.close_line()
        sys.stdout, sys.stderr, warnings.showwarning = self.saved


def console_handlers(streams) -> list[logging.StreamHandler]:
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    return [h for lg in loggers for h in lg.handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
            and any(h.stream is s for s in streams)]


class LineSink:
    """A text stream that hands complete lines to `sink`. A carriage return (a library's own progress bar
    redrawing itself) replaces the line in progress, so only its latest state is kept."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, sink: Callable[..., None]):
        self.sink, self.partial = sink, ""

    def write(self, text: str) -> int:
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            self.sink(line.rsplit("\r", 1)[-1])
        self.partial = self.partial.rsplit("\r", 1)[-1]
        return len(text)

    def close_line(self) -> None:
        if self.partial:
            self.sink(self.partial)
            self.partial = ""

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise io.UnsupportedOperation("the --tui dashboard's log panel has no file descriptor")
