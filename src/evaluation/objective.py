"""Held-out numbers for objective-trained methods (preference, reward, PRM), through the protocol.

The objective that trains a method also measures it: run without gradient
over held-out batches, its loss and metrics (reward accuracy, step accuracy,
margins) are averaged with the same weights the trainer uses.
"""

from __future__ import annotations

from .result import EvalResult

# One held-out result for every method since issue 27; the old name still imports.
ObjectiveEval = EvalResult


def evaluate_objective(backend, handle, batches: list, objective, samples: int) -> EvalResult:
    """Mean loss per count unit and count-weighted metrics over `batches`, without gradient."""
    total, count, sums, weights = 0.0, 0, {}, {}
    for batch in batches:
        n = objective.count(batch)
        if n == 0:
            continue
        loss, metrics = objective(handle, batch, grad=False)
        total += backend.ops.to_float(loss)
        count += n
        for key, value in metrics.items():      # a metric may be absent from some batches
            sums[key] = sums.get(key, 0.0) + value * n
            weights[key] = weights.get(key, 0) + n
    metrics = {key: value / weights[key] for key, value in sums.items()}
    name = objective.accuracy_name
    accuracy = metrics.get(name) if name else None
    return EvalResult(loss=total / max(count, 1), accuracy=accuracy, accuracy_name=name or "accuracy",
                      metrics=metrics, samples=samples)
