"""The accounting of one optimizer step, written once for the torch and MLX trainers.

A step's summed loss is divided by the loss units (an objective's `count`: loss tokens for SFT) of
the whole step, and in a distributed run of every rank's share, so that accumulating micro-batches
gives the gradient of one large batch and N ranks the gradient of one process. `StepLedger` keeps
those numbers: each micro-batch's count, the gradient scale, which micro-batches run, the loss total,
the count-weighted metrics, the real tokens, and the StepResult they make. The runtime's trainer
(backends/torch/trainer.py, backends/mlx/trainer.py) runs the forward and backward passes,
accumulates the gradients, clips them and steps the optimizer.

No runtime here: a distributed run's sums over ranks go through the `all_sum` the trainer hands in
(its all-reduce of a list of floats). Float additions happen in micro-batch order, as the trainers
did them before this module, which keeps losses equal bit for bit across runtimes and resumes.
"""

from __future__ import annotations

import math

from ..distributed import is_placeholder, sum_step, whole
from .protocol import StepResult


class StepLedger:
    """One step's counts and sums. `ranks` and `all_sum` in a distributed run (all_sum None: one process)."""

    def __init__(self, micro_batches, objective, ranks=None, all_sum=None):
        self.ranks, self.all_sum = ranks, all_sum
        self.placeholders = [is_placeholder(b) for b in micro_batches]
        # A placeholder (a rank left without data at the end of an epoch) has no loss units.
        self.counts = [0 if p else objective.count(b) for b, p in zip(micro_batches, self.placeholders)]
        self.step_counts = [whole(c) for c in all_sum(self.counts)] if all_sum else self.counts
        self.units = sum(self.step_counts)        # may be fractional (GRPO weighs sequences)
        # Each rank's gradient is averaged over the ranks; the sum over ranks is what one process computes.
        world = ranks.world if ranks is not None else 1
        self.scale = world / max(self.units, 1)
        self.tokens = sum(getattr(b, "real_tokens", 0) for b, p in zip(micro_batches, self.placeholders) if not p)
        self.total, self.sums, self.weights = 0.0, {}, {}
        self.metrics: dict[str, float] = {}
        self.mean = 0.0

    @property
    def run_by_all(self) -> list[int]:
        """The micro-batches with loss units on any rank: where gradients are synchronised inside the
        backward pass (torch's DDP and FSDP), every rank runs these alike, a placeholder too."""
        return [i for i, n in enumerate(self.step_counts) if n > 0]

    @property
    def run_here(self) -> list[int]:
        """The micro-batches with loss units on this rank: where gradients are averaged once per step
        (MLX), a micro-batch without any contributes neither loss nor gradient and is not run."""
        return [i for i, n in enumerate(self.counts) if n != 0]

    def weight(self, i: int) -> float:
        """What micro-batch i's loss counts for: a placeholder runs with weight zero."""
        return 0.0 if self.placeholders[i] else 1.0

    def add(self, i: int, loss: float, metrics: dict) -> None:
        """Micro-batch i's summed loss (a float) and its objective's metrics, each weighted by its count."""
        weight, n = self.weight(i), self.counts[i]
        self.total += loss * weight
        for key, value in (metrics.items() if weight else ()):   # a metric may be absent from some micro-batches
            self.sums[key] = self.sums.get(key, 0.0) + value * n
            self.weights[key] = self.weights.get(key, 0) + n

    def finish(self) -> None:
        """The step's totals over the ranks, its mean loss and its metrics. In a distributed run every rank
        calls this at the same point of its collectives."""
        if self.all_sum:
            self.total, self.tokens, self.sums, self.weights = sum_step(
                self.ranks, self.all_sum, self.total, self.tokens, self.sums, self.weights)
        self.metrics = {key: value / self.weights[key] for key, value in self.sums.items() if self.weights[key]}
        self.mean = self.total / max(self.units, 1)

    def finite(self, grad_norm: float) -> bool:
        """Whether the update may be applied: a non-finite loss or gradient norm skips it."""
        return math.isfinite(self.mean) and math.isfinite(grad_norm)

    def result(self, grad_norm: float | None, skipped: bool = False) -> StepResult:
        return StepResult(self.mean, self.units, self.tokens, grad_norm, skipped=skipped, metrics=self.metrics)
