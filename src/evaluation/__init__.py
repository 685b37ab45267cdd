"""Measuring a model through the backend protocol: held-out loss, generation checks, objective metrics,
and `mudpuppy eval` (suite.py: targets side by side, report.py: the table, eval.json, charts)."""

from .heldout import EvalResult, evaluate, exact_match, heldout_loss
from .objective import ObjectiveEval, evaluate_objective
from .suite import EvalOptions, EvalReport, measure, run_eval

__all__ = ["EvalOptions", "EvalReport", "EvalResult", "ObjectiveEval", "evaluate", "evaluate_objective",
           "exact_match", "heldout_loss", "measure", "run_eval"]
