"""Measuring a model through the backend protocol: held-out loss, generation checks, objective metrics,
and `mudpuppy eval` (suite.py: targets side by side, report.py: the table, eval.json, charts)."""

from .heldout import EvalResult, evaluate, exact_match, heldout_loss
from .objective import ObjectiveEval, evaluate_objective
from .result import before_after_table, loss_table
from .suite import EvalOptions, EvalReport, measure, run_eval

__all__ = ["EvalOptions", "EvalReport", "EvalResult", "ObjectiveEval", "before_after_table", "evaluate",
           "evaluate_objective", "exact_match", "heldout_loss", "loss_table", "measure", "run_eval"]
