"""run_summary.json's `memory`: the device's peak per phase of a run (load, first step, the steady state,
after training), read from the backend's allocator counters where it has them."""

from __future__ import annotations

import json

import pytest

from mudpuppy import create_backend, load_config, run
from mudpuppy.memory.phases import MemoryPhases


class Counter:
    """A backend whose allocator peaks are scripted: each reading starts a new window."""

    def __init__(self, peaks):
        self.peaks = list(peaks)

    def memory_peaks(self):
        return {"allocated": self.peaks.pop(0)}


def test_each_phase_gets_the_peak_of_its_own_window():
    memory = MemoryPhases(Counter([100, 250, 180, 90]))
    memory.on_run_start(total=3, done=0)
    for step in (1, 2, 3):
        memory.on_step_end(step, {})
    memory.on_run_end()
    memory.record("after_training")
    assert memory.phases == {"load": {"allocated": 100}, "first_step": {"allocated": 250},
                             "training": {"allocated": 180}, "after_training": {"allocated": 90}}


def test_a_loop_that_never_stepped_has_no_training_phase():
    memory = MemoryPhases(Counter([100]))
    memory.on_run_start(total=3, done=3)
    memory.on_run_end()
    assert list(memory.phases) == ["load"]


def test_a_torch_cpu_run_records_no_device_memory(tiny_config):
    tiny_config["training"]["max_steps"] = 2
    tiny_config["eval"] = {"before_training": False, "after_training": False}
    result = run(load_config(tiny_config), create_backend("cpu"), echo=lambda *_: None)
    assert "memory" not in json.loads((result.output_dir / "run_summary.json").read_text())


def test_an_mlx_run_records_its_peak_memory_per_phase(tiny_config):
    pytest.importorskip("mlx.core")
    tiny_config.update(backend="mlx")
    tiny_config["training"]["max_steps"] = 3
    tiny_config["eval"] = {"before_training": False, "after_training": True}
    tiny_config["merge"] = True
    result = run(load_config(tiny_config), create_backend("mlx"), echo=lambda *_: None)
    memory = json.loads((result.output_dir / "run_summary.json").read_text())["memory"]
    assert list(memory) == ["load", "first_step", "training", "after_training", "merge"]
    assert all(phase["allocated"] > 0 for phase in memory.values())
