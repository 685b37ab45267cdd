"""Progress for a run without the dashboard: a tqdm bar on a terminal, plain lines in logs, and `clock`, the
elapsed/eta format both these lines and the --tui dashboard print.

`ProgressLines` is the callback the training loop reports to (callbacks.py);
`postfix` is what both it and the dashboard show after the step count. It
imports nothing of the dashboard (dashboard.py and live.py import it).
"""

from __future__ import annotations

import sys
import time

from .callbacks import Callback


def postfix(metrics: dict) -> dict[str, str]:
    """What a progress line shows of a step: its loss, tokens per second and, where batches were sampled, the
    mean reward."""
    shown = {"loss": f"{metrics['loss']:.4f}", "tok_s": f"{metrics['tokens_per_second']:.0f}"}
    if "reward" in metrics:
        shown["reward"] = f"{metrics['reward']:.3f}"
    return shown


class ProgressLines(Callback):
    """The loop's progress without the dashboard (`logging.progress_bar`, every `logging.progress_every`
    steps off a terminal); nothing when disabled."""

    def __init__(self, enabled: bool, every: int | None = None, stream=None):
        self.enabled, self.every, self.stream = enabled, every, stream
        self.bar = None

    def on_run_start(self, total: int, done: int) -> None:
        self.bar = progress_bar(total, done, self.enabled, self.every, self.stream)

    def on_step_end(self, step: int, metrics: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(**postfix(metrics))
            self.bar.update(1)

    def on_run_end(self) -> None:
        if self.bar is not None:
            self.bar.close()


def progress_bar(total: int, done: int, enabled: bool, every: int | None = None, stream=None):
    """A tqdm bar on a terminal; elsewhere (CI logs, files, pipes) plain lines, one every `every` steps."""
    if not enabled:
        return None
    stream = stream if stream is not None else sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return plain_progress(total, done, every, stream)
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc="train", unit="step", dynamic_ncols=True, file=stream)


def plain_progress(total: int, done: int, every: int | None, stream) -> "PlainProgress":
    return PlainProgress(total, done, every or max(1, round(total / 20)), stream)


class PlainProgress:
    """Progress for logs: `train step 40/200 (20%) loss 0.4312 tok_s 151 elapsed 1m12s eta 4m48s`, one line
    every N steps and at the first and last; no carriage returns. Same calls as the tqdm bar uses."""

    def __init__(self, total: int, done: int, every: int, stream):
        self.total, self.n, self.every, self.stream = total, done, every, stream
        self.start_n, self.start = done, time.perf_counter()
        self.postfix: dict[str, str] = {}

    def set_postfix(self, **fields) -> None:
        self.postfix = {k: str(v) for k, v in fields.items()}

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n == self.start_n + 1 or self.n % self.every == 0 or self.n >= self.total:
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        done = self.n - self.start_n
        eta = elapsed / done * (self.total - self.n) if done else 0.0
        fields = " ".join(f"{k} {v}" for k, v in self.postfix.items())
        pct = f" ({self.n / self.total:.0%})" if self.total else ""
        return (f"train step {self.n}/{self.total}{pct} {fields} elapsed {clock(elapsed)} eta {clock(eta)}"
                .replace("  ", " "))

    def close(self) -> None:
        pass


def clock(seconds: float) -> str:
    """Seconds as the progress lines and the dashboard print them: `1h02m03s`, `4m05s`, `7s`."""
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"
