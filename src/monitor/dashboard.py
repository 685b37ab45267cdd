"""The --tui dashboard's picture: a run's recorded state in, rich renderables out.

Nothing here reads a clock, a device or a terminal. `DashboardState` is fed
what a run produces (the metrics lines metrics.jsonl holds, the lines it
echoes, hardware readings, sample completions), with times given in seconds
since the dashboard started; `render(state, width, height, now)` draws it:

    header      model, method, adapter, backend and device, output directory
    progress    bar, step n/N, epoch, elapsed, ETA, seconds per step
    metrics     every number the run logs, the main ones first, each with its sparkline
    hardware    memory and utilisation readings of the device and the process
    samples     the latest completions of a generative method (GRPO), with their reward
    log         the latest lines the run echoed, warnings in yellow

The live driver (live.py) owns the clock and the terminal.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from rich.console import Group
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from .progress import clock

# Shown first, in this order, when a run logs them; every other number follows in the order it first appears.
MAIN_METRICS = (
    "loss", "eval_loss", "lr", "grad_norm", "tokens_per_second",
    "reward", "eval_reward", "reward_std",                                          # GRPO
    "reward_margin", "reward_accuracy", "eval_reward_margin", "eval_reward_accuracy",  # preference, reward models
    "reward_chosen", "reward_rejected", "kl", "nll", "log_odds", "mse", "step_accuracy", "eval_step_accuracy",
)
# Fields of a metrics line that are not metrics: the axis, and bookkeeping the progress line shows.
NOT_METRICS = {"step", "epoch", "elapsed", "skipped"}
LABELS = {"eval_loss": "held-out loss", "lr": "learning rate", "grad_norm": "grad norm",
          "tokens_per_second": "tokens/s", "tokens": "tokens/step"}
SPARKS = "▁▂▃▄▅▆▇█"
PHASES = {"finishing": "training done: saving and evaluating", "finished": "finished", "stopped": "stopped"}
LOG_KEPT = 500            # echoed lines remembered; the panel shows the newest that fit
SIDE_BY_SIDE = 100        # from this width on, metrics and hardware share a row


@dataclass
class LogLine:
    text: str
    warning: bool = False


@dataclass
class DashboardState:
    """What the dashboard shows, built up as the run goes."""

    header: dict[str, str] = field(default_factory=dict)     # label -> value, in display order
    total: int = 0                 # optimizer steps of the run; 0 until training begins
    step: int = 0
    epoch: int | None = None
    phase: str = "preparing"       # preparing, training, finishing, then finished or stopped
    timeline: list[tuple[int, float]] = field(default_factory=list)   # (step, seconds): the ETA's evidence
    history: dict[str, list[float]] = field(default_factory=dict)     # metric -> its values (ints stay ints)
    log: deque = field(default_factory=lambda: deque(maxlen=LOG_KEPT))
    samples: list[dict] = field(default_factory=list)        # {"prompt", "completion", "reward"}
    hardware: list = field(default_factory=list)             # backends.telemetry.Reading

    def begin(self, total: int, done: int, at: float) -> None:
        """Training starts (or resumes at step `done`): a fresh progress line and fresh curves."""
        self.total, self.step, self.phase = total, done, "training"
        self.timeline = [(done, at)]
        self.history = {}

    def observe(self, record: dict, at: float | None = None) -> None:
        """One metrics line, as metrics.jsonl holds it. `at` defaults to the line's own `elapsed`."""
        for key, value in record.items():
            if key in NOT_METRICS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self.history.setdefault(key, []).append(value)
        if record.get("epoch") is not None:
            self.epoch = int(record["epoch"])
        at = at if at is not None else record.get("elapsed")
        if record.get("step") is not None:
            self.advance(int(record["step"]), at)

    def advance(self, step: int, at: float | None) -> None:
        self.step = max(self.step, step)
        if at is not None and (not self.timeline or step > self.timeline[-1][0]):
            self.timeline.append((step, float(at)))

    def add_log(self, text: str, warning: bool = False) -> None:
        self.log.append(LogLine(text, warning))

    def seconds_per_step(self) -> float | None:
        if len(self.timeline) < 2 or self.timeline[-1][0] <= self.timeline[0][0]:
            return None
        (s0, t0), (s1, t1) = self.timeline[0], self.timeline[-1]
        return (t1 - t0) / (s1 - s0)

    def eta(self) -> float | None:
        rate = self.seconds_per_step()
        return None if rate is None else rate * max(self.total - self.step, 0)

    def metric_names(self) -> list[str]:
        main = [k for k in MAIN_METRICS if k in self.history]
        return main + [k for k in self.history if k not in main]


def render(state: DashboardState, width: int, height: int, now: float | None = None) -> Group:
    """The whole dashboard, `height` lines at most (one is left free for the cursor below a live display);
    the log panel grows with the log up to the lines left."""
    header = header_panel(state, width, now)
    budget = max(height - 1, 16) - 5                      # what is left under the 5-line header
    samples = samples_panel(state.samples) if state.samples else None
    budget -= (len(state.samples) + 2) if samples else 0
    log_min = 5
    rows = max(budget - log_min - 3, 1)                   # metric rows that fit (the table header is 1 line)
    middle, used = metrics_and_hardware(state, width, rows)
    log = log_panel(state.log, min(max(budget - used, 3) - 2, max(len(state.log), 3)))
    return Group(*(p for p in (header, middle, samples, log) if p is not None))


def header_panel(state: DashboardState, width: int, now: float | None) -> Panel:
    title = Text(" · ").join(Text.assemble((f"{k} ", "dim"), (v, "bold")) for k, v in state.header.items())
    title.no_wrap, title.overflow = True, "ellipsis"
    return Panel(Group(title, progress_line(state, width - 4), timing_line(state, now)),
                 title="mudpuppy", title_align="left", border_style="cyan", height=5)


def progress_line(state: DashboardState, width: int):
    if not state.total:
        return Text("waiting for the first training step (the log says what the run is doing)", style="dim")
    label = f" step {state.step}/{state.total} ({state.step / state.total:.0%})"
    grid = Table.grid(expand=True)
    grid.add_column(ratio=1)
    grid.add_column(no_wrap=True)
    grid.add_row(ProgressBar(total=state.total, completed=state.step, width=max(width - len(label) - 1, 10)),
                 Text(label, style="bold"))
    return grid


def timing_line(state: DashboardState, now: float | None) -> Text:
    start = state.timeline[0][1] if state.timeline else 0.0
    if now is None or (state.timeline and state.phase != "training"):
        now = state.timeline[-1][1] if state.timeline else 0.0          # after the last step: training time
    if state.phase == "preparing":
        return Text(f"preparing · elapsed {clock(now)}", style="dim")
    eta, rate = state.eta(), state.seconds_per_step()
    parts = [f"epoch {state.epoch}" if state.epoch is not None else "",
             f"elapsed {clock(now - start)}",
             f"eta {clock(eta)}" if eta is not None and state.phase == "training" else "",
             f"{rate:.2f} s/step" if rate is not None else "",
             PHASES.get(state.phase, "")]
    return Text(" · ".join(p for p in parts if p))


def metrics_and_hardware(state: DashboardState, width: int, rows: int) -> tuple[Group | Table, int]:
    """The metrics panel and the hardware panel, side by side on a wide terminal; and the lines they take."""
    side = width >= SIDE_BY_SIDE
    hw_rows = max(len(state.hardware), 1)
    if side:
        lines = min(max(len(state.history), hw_rows, 1), rows) + 3
        grid = Table.grid(expand=True)
        grid.add_column(ratio=1)
        grid.add_column(ratio=1)
        grid.add_row(metrics_panel(state, rows, lines), hardware_panel(state.hardware, lines))
        return grid, lines
    hw_lines = hw_rows + 2
    lines = min(max(len(state.history), 1), max(rows - hw_lines, 1)) + 3
    return Group(metrics_panel(state, lines - 3, lines), hardware_panel(state.hardware, hw_lines)), lines + hw_lines


def metrics_panel(state: DashboardState, rows: int, height: int) -> Panel:
    table = Table(expand=True, box=None, padding=(0, 1), show_edge=False)
    table.add_column("metric", style="bold", no_wrap=True, overflow="ellipsis", max_width=26)
    table.add_column("last", justify="right", no_wrap=True)
    table.add_column("trend", ratio=1, no_wrap=True, overflow="crop")
    names = state.metric_names()
    shown = names if len(names) <= rows else names[: rows - 1]
    for name in shown:
        values = state.history[name]
        table.add_row(LABELS.get(name, name), format_value(name, values[-1]), Text(sparkline(values, 40), "green"))
    if len(shown) < len(names):
        table.add_row(Text(f"+{len(names) - len(shown)} more in metrics.jsonl", style="dim"), "", "")
    if not names:
        table.add_row(Text("no metrics yet", style="dim"), "", "")
    return Panel(table, title="metrics", title_align="left", border_style="blue", height=height)


def hardware_panel(readings: list, height: int) -> Panel:
    table = Table.grid(padding=(0, 1), expand=True)
    table.add_column(no_wrap=True, overflow="ellipsis", ratio=1)
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True, justify="right")
    for r in readings:
        fraction = r.percent / 100 if r.percent is not None else (r.used / r.total if r.used and r.total else None)
        bar = ProgressBar(total=1.0, completed=fraction, width=10) if fraction is not None else Text("")
        table.add_row(Text.assemble(r.name, (f" {r.source}", "dim") if r.source else ""), bar, describe_reading(r))
    if not readings:
        table.add_row(Text("no readings yet", style="dim"), "", "")
    return Panel(table, title="hardware", title_align="left", border_style="magenta", height=height)


def samples_panel(samples: list[dict]) -> Panel:
    lines = []
    for s in samples:
        reward = s.get("reward")
        line = Text.assemble((f"{reward:+.3f} " if reward is not None else "   -   ", "bold"),
                             (one_line(s.get("prompt", "")), "dim"), " → ", one_line(s.get("completion", "")))
        line.no_wrap, line.overflow = True, "ellipsis"
        lines.append(line)
    return Panel(Group(*lines), title="latest samples (reward, prompt → completion)", title_align="left",
                 border_style="green")


def log_panel(log, rows: int) -> Panel:
    shown = list(log)[-rows:] if rows > 0 else []
    lines = [Text(line.text, style="yellow" if line.warning else "", no_wrap=True, overflow="ellipsis")
             for line in shown]
    return Panel(Group(*lines) if lines else Text("nothing yet", style="dim"), title="log", title_align="left",
                 border_style="white", height=max(rows, 1) + 2)


def describe_reading(r) -> str:
    if r.percent is not None:
        return f"{r.percent:.0f}%"
    if r.used is not None and r.total:
        return f"{gib(r.used)}/{gib(r.total)} GiB"
    return f"{gib(r.used)} GiB" if r.used is not None else "-"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def format_value(name: str, value: float) -> str:
    """A metric's last value: learning rates in scientific notation, others with the digits that matter."""
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    if name == "lr" or name.endswith("/lr"):
        return f"{value:.2e}"
    size = abs(value)
    if value == 0:
        return "0"
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 100:
        return f"{value:.1f}"
    if size >= 10:
        return f"{value:.2f}"
    if size < 1e-3:
        return f"{value:.2e}"
    return f"{value:.4f}"


def sparkline(values: list[float], width: int) -> str:
    """The last `width` values as block characters, lowest to highest; gaps (NaN) as spaces."""
    shown = values[-width:]
    finite = [v for v in shown if math.isfinite(v)]
    if not finite:
        return " " * len(shown)
    low, high = min(finite), max(finite)
    span = high - low

    def block(v: float) -> str:
        if not math.isfinite(v):
            return " "
        return SPARKS[3] if span == 0 else SPARKS[round((v - low) / span * (len(SPARKS) - 1))]

    return "".join(block(v) for v in shown)


def one_line(text) -> str:
    """A prompt or completion on one line: messages become their last content, newlines become spaces."""
    if isinstance(text, list):
        text = text[-1].get("content", "") if text and isinstance(text[-1], dict) else " ".join(map(str, text))
    return " ".join(str(text).split())


