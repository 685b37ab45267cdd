"""Where a run's device memory goes: the peak of each phase, for run_summary.json's `memory`.

Phases: `load` (everything before the first step: the model, the adapter, the evaluation before
training), `first_step` (the first optimizer step, where optimizer state and compiled kernels appear),
`training` (every later step: the steady state), `after_training` (the evaluation after training, once the
trainer has released its optimizer state and gradients) and `merge` (merge: true, on the host beside a GPU
run: the device's peak while it ran), both written by the recipe (training/session.py). Each is the
backend's `memory_peaks()` over that window: torch's max_memory_allocated / max_memory_reserved on a GPU,
mlx's peak memory; nothing on a torch CPU run, where the process's RSS is the measure (the --tui dashboard
shows it). `with_memory` puts them in the summary.
"""

from __future__ import annotations

from ..monitor.callbacks import Callback


class MemoryPhases(Callback):
    """Reads the backend's peak memory at each phase boundary of a training loop."""

    def __init__(self, backend):
        self.backend = backend
        self.phases: dict[str, dict[str, int]] = {}
        self.stepped = False

    def record(self, phase: str) -> None:
        peaks = self.backend.memory_peaks()
        if peaks is not None:
            self.phases[phase] = peaks

    def on_run_start(self, total: int, done: int) -> None:
        self.record("load")

    def on_step_end(self, step: int, metrics: dict) -> None:
        if not self.stepped:
            self.stepped = True
            self.record("first_step")

    def on_run_end(self) -> None:
        if self.stepped:
            self.record("training")


def with_memory(summary: dict, memory: MemoryPhases) -> dict:
    """The summary with the run's peak device memory per phase, where the backend has it."""
    if memory.phases:
        summary["memory"] = memory.phases
    return summary
