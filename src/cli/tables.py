"""The before/after table printed at the end of a run: held-out loss, exact match, accuracy or GRPO's
held-out rewards, one row each, evaluated before and after training (evaluation/result.py draws it)."""

from __future__ import annotations

from ..evaluation.result import before_after_table as draw


def before_after_table(result) -> str:
    """The rows that either evaluation of `result` (a RunResult) measured, aligned; an empty string when
    neither ran."""
    return draw(result.before, result.after)
