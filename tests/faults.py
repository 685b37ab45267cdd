"""Fault injection for the resume tests: the environment of a process (and of the copies it launches) whose
run is killed right after step `step`, through a callback (tests/killer/kill_after_step.py); mudpuppy
itself reads nothing of it."""

from __future__ import annotations

import os
from pathlib import Path

from .killer.kill_after_step import RANK_ENV, STEP_ENV

KILLER = Path(__file__).resolve().parent / "killer"


def kill_after(step: int, rank: int | None = None) -> dict[str, str]:
    """Environment entries for a process to start: SIGKILL after step `step`, on rank `rank` only when given."""
    path = os.pathsep.join(p for p in (str(KILLER), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, STEP_ENV: str(step), **({RANK_ENV: str(rank)} if rank is not None else {})}
