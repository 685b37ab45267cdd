"""The experiment trackers' old import path: they are a monitor/ callback now (mudpuppy.monitor.trackers).

Kept so that `from mudpuppy.training import trackers` goes on working; new code imports monitor.trackers.
"""

from __future__ import annotations

import importlib.util      # the same module object as monitor.trackers', for code that patches find_spec here

from ..monitor.trackers import (
    EXTRAS, KINDS, MODULES, TRACKERS, MLflow, TensorBoard, Trackers, Trackio, WandB, check_available,
    close_trackers, flatten, flatten_numbers, numeric, open_trackers,
)

__all__ = ["EXTRAS", "KINDS", "MODULES", "TRACKERS", "MLflow", "TensorBoard", "Trackers", "Trackio", "WandB",
           "check_available", "close_trackers", "flatten", "flatten_numbers", "importlib", "numeric",
           "open_trackers"]
