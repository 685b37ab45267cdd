"""Measuring a model through the backend protocol: held-out loss, generation checks, objective metrics."""

from .heldout import EvalResult, evaluate, exact_match, heldout_loss
from .objective import ObjectiveEval, evaluate_objective

__all__ = ["EvalResult", "ObjectiveEval", "evaluate", "evaluate_objective", "exact_match", "heldout_loss"]
