"""GRPO's maths: group-relative advantages (numpy) and the clipped policy loss (ArrayOps).

Both follow TRL 1.16's GRPOTrainer to the letter (`_generate_and_score_completions`
for the advantages, `_compute_loss` for the loss) and are checked against it in
tests/training/test_grpo_oracle.py. What TRL does that is easy to get wrong, and
is kept here:

- rewards are weighted and summed per completion with NaN (a function's None)
  counted as 0, but a completion every function declined is unscorable: it is left
  out of its group's mean and std, and its advantage is 0;
- the std is the sample std (Bessel's correction), plus 1e-4;
- log-probs are those of logits / temperature (the distribution sampled from);
- the ratio is exp(logp - old logp), exactly 1 when the update is on-policy, and
  its clipping range is [1 - epsilon, 1 + epsilon_high], optionally capped at delta;
- the KL to the reference is the k3 estimator exp(ref - logp) - (ref - logp) - 1;
- the four normalisations (loss_type) differ only in what the summed token losses
  are divided by.

Token arrays are flat: one entry per completion token that carries loss, row-major,
with `rows` saying which completion each belongs to. That is the layout the
backends' token_logprobs return, and it is TRL's [B, T] tensors with the padding
(mask 0) left out.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from ..backends.routing import with_router_aux
from ..data import Batch

STD_EPS = 1e-4


# --------------------------------------------------------------------------- advantages

@dataclass
class Advantages:
    advantages: np.ndarray      # float32 [n]
    rewards: np.ndarray         # float64 [n], weighted sum; NaN where unscorable
    std_is_zero: np.ndarray     # bool [n]: the std the advantage was scaled by is 0 (no signal)


def group_advantages(rewards_per_func: np.ndarray, weights: np.ndarray, num_generations: int,
                     scale_rewards: str) -> Advantages:
    """Advantages of n completions (consecutive groups of num_generations), TRL's sum_then_normalize.

    `rewards_per_func` is [n, functions] with NaN where a function returned None."""
    r = np.asarray(rewards_per_func, dtype=np.float64)
    unscorable = np.isnan(r).all(axis=1)
    rewards = np.nansum(r * np.asarray(weights, dtype=np.float64)[None, :], axis=1)
    rewards[unscorable] = np.nan
    grouped = rewards.reshape(-1, num_generations)
    with warnings.catch_warnings():           # all-NaN groups and groups of one give NaN, as in TRL
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.repeat(np.nanmean(grouped, axis=1), num_generations)
        if scale_rewards == "batch":
            std = np.full_like(rewards, nanstd(rewards))
        else:                                 # group, and none (whose std is only reported)
            std = np.repeat(np.array([nanstd(g) for g in grouped]), num_generations)
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + STD_EPS)
    std_is_zero = np.isclose(std, 0.0)
    return Advantages(np.nan_to_num(advantages, nan=0.0).astype(np.float32), rewards, std_is_zero)


def nanstd(x: np.ndarray) -> float:
    """Sample std over the non-NaN entries (TRL's nanstd): NaN for fewer than two."""
    x = np.asarray(x, dtype=np.float64)
    x = x[~np.isnan(x)]
    if len(x) < 2:
        return float("nan")
    return float(np.std(x, ddof=1))


# --------------------------------------------------------------------------- the micro-batch

@dataclass
class RolloutBatch:
    """Completions with their prompts, ready for the loss: what the GRPO objective consumes."""

    batch: Batch                    # prompt + completion per row, right-padded; labels on completion tokens
    advantages: np.ndarray          # float32 [B]
    rows: np.ndarray                # int [N]: the row of each loss token, row-major
    old_logps: np.ndarray | None    # float32 [N]; None when on-policy (the ratio is then exactly 1)
    ref_logps: np.ndarray | None    # float32 [N]; None when beta is 0
    dapo_count: float = 0.0         # dapo's normaliser share: generation-batch tokens / steps_per_generation

    @property
    def size(self) -> int:
        return int(self.batch.input_ids.shape[0])

    @property
    def real_tokens(self) -> int:
        return self.batch.real_tokens

    @property
    def lengths(self) -> np.ndarray:
        """Loss-carrying tokens per completion [B]."""
        return np.bincount(self.rows, minlength=self.size)


# --------------------------------------------------------------------------- the loss

def policy_loss(ops, logps, batch: RolloutBatch, cfg, max_completion_length: int):
    """(summed loss, per-token loss pieces for metrics) of one micro-batch.

    The sum is what the trainer divides by the step's summed `count`, so that
    accumulating micro-batches reproduces TRL's loss for each loss_type (see
    GrpoObjective.count)."""
    n, rows = batch.size, batch.rows
    old = logps if batch.old_logps is None else ops.from_numpy(batch.old_logps)
    log_ratio = logps - ops.detach(old)
    lengths = np.maximum(batch.lengths, 1).astype(np.float32)
    if cfg.importance_sampling_level == "sequence":
        per_row = ops.row_sum(log_ratio, rows, n) / ops.from_numpy(lengths)
        log_weights = ops.take(per_row, rows)
    else:
        log_weights = log_ratio
    coef_1 = ops.exp(log_weights)
    kl = None
    if cfg.beta != 0.0:
        diff = ops.from_numpy(batch.ref_logps) - logps
        kl = ops.exp(diff) - diff - 1.0
        if cfg.use_bias_correction_kl:      # the KL of samples drawn from the old policy, reweighted
            kl = kl * coef_1
    coef_2 = ops.clip(coef_1, 1.0 - cfg.epsilon, 1.0 + cfg.epsilon_upper)
    if cfg.delta is not None:
        coef_1 = ops.clip(coef_1, high=cfg.delta)
    adv = ops.from_numpy(batch.advantages[rows].astype(np.float32))
    per_token = -ops.minimum(coef_1 * adv, coef_2 * adv)
    if kl is not None:
        per_token = per_token + cfg.beta * kl
    if cfg.loss_type == "grpo":
        total = ops.sum(ops.row_sum(per_token, rows, n) / ops.from_numpy(lengths))
    elif cfg.loss_type == "bnpo":
        total = ops.sum(per_token) * (float(n) / max(len(rows), 1))
    elif cfg.loss_type == "dr_grpo":
        total = ops.sum(per_token) / float(max_completion_length)
    else:                                   # dapo
        total = ops.sum(per_token)
    return total, coef_1, adv, kl


class GrpoObjective:
    """The trainer's objective (protocol.Objective) for GRPO micro-batches (RolloutBatch)."""

    def __init__(self, backend, grpo_cfg):
        self.backend, self.ops, self.cfg = backend, backend.ops, grpo_cfg

    def count(self, batch: RolloutBatch) -> float:
        """What the step's summed loss is divided by, summed over its micro-batches.

        grpo, bnpo and dr_grpo: TRL averages over each micro-batch and divides by the
        accumulation steps, so the count is the micro-batch's completions. dapo: TRL
        divides every micro-batch by the generation batch's loss tokens scaled to one
        accumulation window (x accumulation / steps_per_generation), so each micro-batch
        counts for that share."""
        return batch.dapo_count if self.cfg.loss_type == "dapo" else float(batch.size)

    def __call__(self, handle, batch: RolloutBatch, grad: bool = True):
        ops, c = self.ops, self.cfg
        logps, entropy, aux = self.backend.token_logprobs(handle, batch.batch, grad=grad, temperature=c.temperature,
                                                          entropy=True, router_aux=True)
        total, coef_1, adv, kl = policy_loss(ops, logps, batch, c, c.max_completion_length)
        # TRL adds the term once per micro-batch, divided by the accumulation steps: once per unit of count().
        total, aux_metric = with_router_aux(ops, total, aux, self.count(batch))
        return total, {**self.metrics(batch, coef_1, adv, kl, entropy), **aux_metric}

    def metrics(self, batch: RolloutBatch, coef_1, adv, kl, entropy) -> dict[str, float]:
        """TRL's names: clip ratios (token means; sequence means at sequence level), entropy, kl."""
        c = self.cfg
        ratio, a = self.ops.to_numpy(coef_1), batch.advantages[batch.rows]
        if len(ratio) == 0:
            return {}
        low = (ratio < 1.0 - c.epsilon) & (a < 0)
        high = (ratio > 1.0 + c.epsilon_upper) & (a > 0)
        region = low | high
        if c.importance_sampling_level == "sequence":
            # One value per completion, as TRL counts them: completions without loss tokens
            # (masked as truncated) have ratio 1 there, so they count as not clipped.
            low, high, region = (per_completion(flag, batch.rows, batch.size) for flag in (low, high, region))
        out = {"clip_ratio/low_mean": float(low.mean()), "clip_ratio/high_mean": float(high.mean()),
               "clip_ratio/region_mean": float(region.mean())}
        if entropy is not None and len(entropy):
            out["entropy"] = float(np.mean(entropy))
        if kl is not None:
            out["kl"] = float(self.ops.to_numpy(kl).mean())
        return out


def per_completion(flags: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """A per-token flag that is constant within a completion, as one value per completion [n]."""
    out = np.zeros(n, dtype=bool)
    out[rows] = flags
    return out
