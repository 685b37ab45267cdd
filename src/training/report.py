"""The run report's old import path: the charts and model card live in monitor/ now (mudpuppy.monitor.report).

Kept so that `from mudpuppy.training.report import model_card` goes on working; new code imports monitor.report.
"""

from __future__ import annotations

from ..monitor.report import (
    CARD, LOSS_PNG, METHOD_CURVES, model_card, read_metrics, results_table, series, settings_rows, smooth,
    write_charts, write_run_report,
)

__all__ = ["CARD", "LOSS_PNG", "METHOD_CURVES", "model_card", "read_metrics", "results_table", "series",
           "settings_rows", "smooth", "write_charts", "write_run_report"]
