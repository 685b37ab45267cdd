"""docs/eval.md stays true: every flag of `mudpuppy eval` and every metric has its row."""

from __future__ import annotations

import re
from pathlib import Path

from mudpuppy.cli import main
from mudpuppy.evaluation.metrics import METRICS

DOC = (Path(__file__).resolve().parents[2] / "docs" / "eval.md").read_text()


def test_every_flag_is_documented():
    flags = [opt for p in main.commands["eval"].params for opt in p.opts if opt.startswith("--") and opt != "--help"]
    table = set(re.findall(r"^\| `(--[a-z-]+)", DOC, re.M))
    assert set(flags) == table


def test_every_metric_is_documented():
    table = set(re.findall(r"^\| `([a-z_]+)` \| ", DOC.split("## Metrics", 1)[1], re.M))
    assert set(METRICS) <= table
