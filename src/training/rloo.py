"""RLOO's maths: leave-one-out advantages (numpy) and the sequence-level clipped loss (ArrayOps).

RLOO runs on GRPO's recipe (grpo.py: setup, loop, save) and rollouts (rollout.py:
sampling, scoring, micro-batches); only these two pieces differ. Both follow TRL
1.16's RLOOTrainer (`_generate_and_score_completions` for the advantages,
`_compute_loss` for the loss) and are checked against it in
tests/training/test_rloo_oracle.py. What TRL does, and is kept here:

- rewards are weighted and summed as GRPO's (NaN counted as 0, a completion every
  function declined unscorable), then clipped to reward_clip_range;
- the KL to the reference goes into the reward, not the loss: each completion's
  reward loses beta x the sum over its tokens of (old logp - ref logp), the first-order
  estimate of the RLOO paper (it can be negative);
- the baseline of a completion is the mean reward of the other scorable completions
  of its prompt; an unscorable completion, or one whose siblings are all unscorable,
  gets advantage 0;
- normalize_advantages scales the whole generation batch to mean 0 and std 1 (sample
  std, plus 1e-4);
- the ratio is one per completion: exp(sum of its token log-ratios), clipped to
  [1 - epsilon, 1 + epsilon_high]; the loss is the mean over the micro-batch's
  completions (a completion with no loss tokens counts, with ratio 1).
"""

from __future__ import annotations

import warnings

import numpy as np

from ..backends.routing import with_router_aux
from .grpo_loss import STD_EPS, Advantages, RolloutBatch, clip_metrics, nanstd, weighted_rewards


def rloo_advantages(rewards_per_func: np.ndarray, weights: np.ndarray, num_generations: int,
                    normalize: bool = False, clip_range: tuple[float, float] | None = None,
                    kl: np.ndarray | None = None, beta: float = 0.0) -> Advantages:
    """Advantages of n completions (consecutive groups of num_generations), TRL's RLOO.

    `rewards_per_func` is [n, functions] with NaN where a function returned None; `kl` [n] is
    each completion's summed per-token (old logp - ref logp), used when beta > 0. `rewards`
    in the result is the weighted sum before clipping and KL (what TRL logs)."""
    rewards, unscorable = weighted_rewards(rewards_per_func, weights)
    r = rewards.copy()
    if clip_range is not None:
        r = np.clip(r, clip_range[0], clip_range[1])
    if beta != 0.0 and kl is not None:
        r = r - beta * np.asarray(kl, dtype=np.float64)
    grouped = r.reshape(-1, num_generations)
    scorable = (~np.isnan(grouped)).sum(axis=1, keepdims=True)
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)          # a lone scorable completion: 0/0, as in TRL
        baselines = (np.nansum(grouped, axis=1, keepdims=True) - grouped) / (scorable - 1)
        advantages = r - baselines.reshape(-1)
        if normalize:
            advantages = (advantages - np.nanmean(advantages)) / (nanstd(advantages) + STD_EPS)
        std = np.repeat(np.array([nanstd(g) for g in grouped]), num_generations)
    return Advantages(np.nan_to_num(advantages, nan=0.0).astype(np.float32), rewards, np.isclose(std, 0.0))


def rloo_loss(ops, logps, batch: RolloutBatch, cfg):
    """(summed loss over the micro-batch's completions, per-completion ratio coef_1 [B])."""
    n, rows = batch.size, batch.rows
    old = logps if batch.old_logps is None else ops.from_numpy(batch.old_logps)
    coef_1 = ops.exp(ops.row_sum(logps - ops.detach(old), rows, n))
    coef_2 = ops.clip(coef_1, 1.0 - cfg.epsilon, 1.0 + cfg.epsilon_upper)
    adv = ops.from_numpy(np.asarray(batch.advantages, dtype=np.float32))
    return ops.sum(-ops.minimum(coef_1 * adv, coef_2 * adv)), coef_1


class RlooObjective:
    """The trainer's objective (protocol.Objective) for RLOO micro-batches (RolloutBatch)."""

    def __init__(self, backend, rloo_cfg):
        self.backend, self.ops, self.cfg = backend, backend.ops, rloo_cfg

    def count(self, batch: RolloutBatch) -> float:
        """TRL averages each micro-batch over its completions, then over the accumulation steps."""
        return float(batch.size)

    def __call__(self, handle, batch: RolloutBatch, grad: bool = True):
        logps, entropy, aux = self.backend.token_logprobs(handle, batch.batch, grad=grad,
                                                          temperature=self.cfg.temperature, entropy=True,
                                                          router_aux=True)
        total, coef_1 = rloo_loss(self.ops, logps, batch, self.cfg)
        total, aux_metric = with_router_aux(self.ops, total, aux, self.count(batch))
        return total, {**self.metrics(batch, coef_1, entropy), **aux_metric}

    def metrics(self, batch: RolloutBatch, coef_1, entropy) -> dict[str, float]:
        """TRL's names: the clip ratios (over completions) and the token-mean entropy."""
        out = clip_metrics(self.ops.to_numpy(coef_1), batch.advantages, self.cfg)
        if entropy is not None and len(entropy):
            out["entropy"] = float(np.mean(entropy))
        return out
