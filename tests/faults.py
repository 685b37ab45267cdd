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


class StopAfter:
    """A backend whose trainer stops the run at once (as a second Ctrl-C) when asked for step k + 1: the
    checkpoint of step k is the newest complete one, as after a preempted job."""

    def __init__(self, inner, k: int):
        self.inner, self.k, self.calls = inner, k, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def create_trainer(self, handle, cfg):
        trainer = self.inner.create_trainer(handle, cfg)
        step = trainer.step

        def stopping(*args, **kwargs):
            self.calls += 1
            if self.calls > self.k:
                raise KeyboardInterrupt
            return step(*args, **kwargs)

        trainer.step = stopping
        return trainer
