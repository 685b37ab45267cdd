"""metrics.jsonl, the run's own record of what it logged: one JSON object per line, as a loop callback.

Each record the loop logs (a step's numbers every logging.log_every steps, the
held-out numbers every training.eval_steps) becomes a line, flushed at once so
a crash keeps everything logged. The charts and model card (report.py) and
`mudpuppy eval`'s readers read it back; the trackers get the same records.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from .callbacks import Callback

METRICS = "metrics.jsonl"


class MetricsLog:
    """One JSON object per line, flushed each time, so a crash keeps everything logged.

    On resume, lines logged after the checkpoint's step (by the run that died)
    are dropped first, so the file reads as one uninterrupted run. `written(out)`
    is told each time the file grows (the run directory's marker lists what appeared).
    """

    def __init__(self, out: Path, truncate_after: int | None = None,
                 written: Callable[[Path], None] | None = None):
        self.path = out / METRICS
        self.written = written or (lambda _out: None)
        if truncate_after is not None and self.path.exists():
            kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= truncate_after]
            self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        self.fh = self.path.open("a", encoding="utf-8")
        self.written(out)

    def write(self, **fields) -> None:
        self.fh.write(json.dumps(fields) + "\n")
        self.fh.flush()
        self.written(self.path.parent)

    def close(self) -> None:
        self.fh.close()


class MetricsFile(Callback):
    """The loop's callback writing metrics.jsonl in `out`: opened (and cut back to the resumed step) when the
    loop starts, a line per record, closed when it ends."""

    def __init__(self, out: Path, written: Callable[[Path], None] | None = None):
        self.out, self.written = Path(out), written
        self.log: MetricsLog | None = None

    def on_run_start(self, total: int, done: int) -> None:
        self.log = MetricsLog(self.out, truncate_after=done, written=self.written)

    def on_log(self, record: dict) -> None:
        self.log.write(**record)

    def on_run_end(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None
