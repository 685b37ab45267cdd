"""Measuring a model through the backend protocol: held-out loss, generation checks."""

from .heldout import EvalResult, evaluate, exact_match, heldout_loss

__all__ = ["EvalResult", "evaluate", "exact_match", "heldout_loss"]
