"""A run page's extras: the hardware readings the --tui dashboard shows, and an online method's sampled
completions.

    hardware   what the dashboard's hardware panel shows (backends/telemetry.py's Reading), read for the
               process training in the run folder (the lock's holder) from outside it: its resident memory
               against the machine's, and its CPU use (psutil, where the `tui` extra installed it). The device's own readings (NVML, amdsmi, mlx) are the training process's to take; the
               page shows instead the device memory peaks the run records per phase (run_summary.json's
               `memory`: load, first_step, training, ...).
    samples    the newest lines of completions.jsonl, which GRPO, RLOO and online DPO write with
               rollout.log_completions: step, prompt, completion, each reward function's reward, advantage.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from ..backends.telemetry import Reading
from ..output_dir import records, rundir
from .runs import lock_holder

COMPLETIONS = "completions.jsonl"     # training/rollout.py's COMPLETIONS
SAMPLES_SHOWN = 8
TAIL_BYTES = 256 * 1024


class Hardware:
    """Readings of the processes training under the page's folder; psutil's Process kept per pid so that
    its CPU percentage is the use since the previous reading, as the dashboard's is."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seen: dict[int, object] = {}

    def readings(self, folder: Path) -> list[Reading]:
        pid = lock_holder(folder)
        if pid is None:
            return []
        try:
            import psutil
        except ImportError:
            return []
        with self.lock:
            try:
                proc = self.seen.get(pid) or psutil.Process(pid)
                self.seen[pid] = proc
                rss, busy = proc.memory_info().rss, proc.cpu_percent(interval=None)
            except psutil.Error:
                self.seen.pop(pid, None)
                return []
        return [Reading("process RSS", used=rss, total=psutil.virtual_memory().total, source="psutil"),
                Reading("CPU busy", percent=busy, source="psutil")]

    def describe(self, folder: Path) -> dict:
        """{"live": readings of the training process, "peaks": the run's recorded memory peaks per phase}."""
        live = [{"name": r.name, "source": r.source, "used": r.used, "total": r.total, "percent": r.percent,
                 "fraction": fraction(r)} for r in self.readings(folder)]
        summary = records.read_json(folder / rundir.SUMMARY) or {}
        memory = summary.get("memory") if isinstance(summary.get("memory"), dict) else {}
        peaks = [{"phase": phase, **{k: v for k, v in values.items() if isinstance(v, (int, float))}}
                 for phase, values in memory.items() if isinstance(values, dict)]
        return {"live": live, "peaks": peaks}


def fraction(r: Reading) -> float | None:
    """How full the dashboard's bar is for this reading."""
    if r.percent is not None:
        return max(0.0, min(1.0, r.percent / 100))
    return r.used / r.total if r.used and r.total else None


def samples(folder: Path, limit: int = SAMPLES_SHOWN) -> list[dict]:
    """The newest `limit` sampled completions the run logged (completions.jsonl), newest last."""
    path = folder / COMPLETIONS
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            fh.seek(max(0, size - TAIL_BYTES))
            data = fh.read()
    except OSError:
        return []
    rows = []
    for line in data.splitlines()[-limit - 1:]:
        try:
            row = json.loads(line)
        except ValueError:
            continue                    # the first line cut by the tail, or one being written
        if isinstance(row, dict) and isinstance(row.get("completion"), str):
            rewards = row.get("rewards") if isinstance(row.get("rewards"), dict) else {}
            rows.append({"step": row.get("step"), "prompt": _text(row.get("prompt")), "completion": row["completion"],
                         "rewards": {k: v for k, v in rewards.items() if isinstance(v, (int, float)) or v is None},
                         "advantage": row.get("advantage")})
    return rows[-limit:]


def _text(prompt) -> str:
    """A prompt as text: a string as it is, a conversation as its last user turn."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        turns = [m.get("content") for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str)]
        return turns[-1] if turns else ""
    return ""
