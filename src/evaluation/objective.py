"""Held-out numbers for objective-trained methods (preference, reward, PRM), through the protocol.

The objective that trains a method also measures it: run without gradient
over held-out batches, its loss and metrics (reward accuracy, step accuracy,
margins) are averaged with the same weights the trainer uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ObjectiveEval:
    loss: float
    accuracy: float | None               # the method's headline accuracy (reward or step accuracy)
    accuracy_name: str = "accuracy"
    metrics: dict[str, float] = field(default_factory=dict)
    samples: int = 0                     # held-out items (pairs, examples, steps' sequences)

    def as_dict(self) -> dict:
        return {"loss": self.loss, "accuracy": self.accuracy, "accuracy_name": self.accuracy_name,
                "metrics": self.metrics, "samples": self.samples}

    @classmethod
    def from_dict(cls, data: dict) -> "ObjectiveEval":
        return cls(**data)

    def describe(self) -> str:
        acc = f", {self.accuracy_name} {self.accuracy:.1%}" if self.accuracy is not None else ""
        return f"held-out loss {self.loss:.4f}{acc} ({self.samples} examples)"


def evaluate_objective(backend, handle, batches: list, objective, samples: int) -> ObjectiveEval:
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
    return ObjectiveEval(total / max(count, 1), accuracy, name or "accuracy", metrics, samples)
