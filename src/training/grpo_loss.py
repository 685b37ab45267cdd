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
- grpo, bnpo, dr_grpo, dapo and luspo share the clipped token loss and differ only
  in what the summed token losses are divided by; cispo, sapo and vespo weigh each
  token differently (a capped, detached ratio times the log-prob; a sigmoid gate on
  the ratio; a detached Gamma weight of the sequence's ratio times the log-prob).

Token arrays are flat: one entry per completion token that carries loss, row-major,
with `rows` saying which completion each belongs to. That is the layout the
backends' token_logprobs return, and it is TRL's [B, T] tensors with the padding
(mask 0) left out.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from ..backends.routing import with_router_aux
from ..data import Batch

STD_EPS = 1e-4
# The loss types TRL divides by the generation batch's loss tokens (num_items_in_batch), scaled to one
# accumulation window; the others average over each micro-batch's completions.
GENERATION_NORMALISED = ("dapo", "cispo", "vespo")


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
    rewards, _ = weighted_rewards(rewards_per_func, weights)
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


def weighted_rewards(rewards_per_func: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the weighted sum per completion [n] with NaN counted as 0, NaN where every function declined;
    that unscorable mask [n])."""
    r = np.asarray(rewards_per_func, dtype=np.float64)
    unscorable = np.isnan(r).all(axis=1)
    rewards = np.nansum(r * np.asarray(weights, dtype=np.float64)[None, :], axis=1)
    rewards[unscorable] = np.nan
    return rewards, unscorable


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
    dapo_count: float = 0.0         # dapo's, cispo's and vespo's normaliser share: generation-batch tokens
                                    # / steps_per_generation

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
    """(summed loss, ratio coef_1, KL or None, vespo's per-completion weights or None) of one micro-batch.

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
    adv_np = batch.advantages[rows].astype(np.float32)
    adv = ops.from_numpy(adv_np)
    phi = None
    if cfg.loss_type == "cispo":            # the ratio capped (not clipped) at epsilon_high, as a constant
        per_token = -ops.detach(ops.clip(coef_1, high=cfg.epsilon_upper)) * adv * logps
    elif cfg.loss_type == "sapo":           # a soft gate: sigmoid(t (ratio - 1)) 4 / t, t by the advantage's sign
        t = ops.from_numpy(np.where(adv_np > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
                           .astype(np.float32))
        per_token = -(ops.sigmoid(t * (coef_1 - 1.0)) * 4.0 / t) * adv
    elif cfg.loss_type == "vespo":          # a detached per-completion weight; the token ratio whatever the level
        phi = gamma_weights(ops.to_numpy(log_ratio), rows, n, batch.advantages, cfg)
        per_token = -ops.from_numpy(phi[rows]) * adv * logps
    else:                                   # grpo, bnpo, dr_grpo, dapo, luspo: PPO's clipped ratio
        coef_2 = ops.clip(coef_1, 1.0 - cfg.epsilon, 1.0 + cfg.epsilon_upper)
        if cfg.delta is not None:
            coef_1 = ops.clip(coef_1, high=cfg.delta)
        per_token = -ops.minimum(coef_1 * adv, coef_2 * adv)
    if kl is not None:
        per_token = per_token + cfg.beta * kl
    if cfg.loss_type in ("grpo", "sapo"):
        total = ops.sum(ops.row_sum(per_token, rows, n) / ops.from_numpy(lengths))
    elif cfg.loss_type == "bnpo":
        total = ops.sum(per_token) * (float(n) / max(len(rows), 1))
    elif cfg.loss_type == "dr_grpo":
        total = ops.sum(per_token) / float(max_completion_length)
    else:                                   # dapo, cispo, vespo (count: their share of the generation's
        total = ops.sum(per_token)          # tokens); luspo (count: completions), each summed over its tokens
    return total, coef_1, kl, phi


def gamma_weights(log_ratio: np.ndarray, rows: np.ndarray, n: int, advantages: np.ndarray, cfg) -> np.ndarray:
    """VESPO's phi(w) = exp(lambda + k log w - lambda w) per completion [n] (float32, no gradient), TRL's
    get_gamma_weights: w is the product (not the mean) of the completion's token ratios, each log-ratio
    clamped to [-20, 20] and the sum to [log 1e-8, 20]; k and lambda by the advantage's sign (>= 0: the
    _pos pair); non-finite weights are 0."""
    lower = np.float32(math.log(1e-8))
    per_token = np.clip(log_ratio.astype(np.float32), -20.0, 20.0)
    seq = np.bincount(rows, weights=per_token, minlength=n).astype(np.float32)
    log_w = np.clip(seq, lower, np.float32(20.0))
    nonneg = np.asarray(advantages) >= 0
    k = np.where(nonneg, cfg.vespo_k_pos, cfg.vespo_k_neg).astype(np.float32)
    lam = np.maximum(np.where(nonneg, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg), 1e-4).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        phi = np.exp(lam + k * log_w - lam * np.exp(log_w))
    return np.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0).astype(np.float32)


class GrpoObjective:
    """The trainer's objective (protocol.Objective) for GRPO micro-batches (RolloutBatch)."""

    def __init__(self, backend, grpo_cfg):
        self.backend, self.ops, self.cfg = backend, backend.ops, grpo_cfg

    def count(self, batch: RolloutBatch) -> float:
        """What the step's summed loss is divided by, summed over its micro-batches.

        grpo, sapo, bnpo, dr_grpo and luspo: TRL averages over each micro-batch (grpo and
        sapo: the completions' token means; luspo: the completions' token sums) and divides
        by the accumulation steps, so the count is the micro-batch's completions. dapo,
        cispo and vespo: TRL divides every micro-batch by the generation batch's loss
        tokens scaled to one accumulation window (x accumulation / steps_per_generation),
        so each micro-batch counts for that share."""
        return batch.dapo_count if self.cfg.loss_type in GENERATION_NORMALISED else float(batch.size)

    def __call__(self, handle, batch: RolloutBatch, grad: bool = True):
        ops, c = self.ops, self.cfg
        logps, entropy, aux = self.backend.token_logprobs(handle, batch.batch, grad=grad, temperature=c.temperature,
                                                          entropy=True, router_aux=True)
        total, coef_1, kl, phi = policy_loss(ops, logps, batch, c, c.max_completion_length)
        # TRL adds the term once per micro-batch, divided by the accumulation steps: once per unit of count().
        total, aux_metric = with_router_aux(ops, total, aux, self.count(batch))
        return total, {**self.metrics(batch, coef_1, kl, entropy, phi), **aux_metric}

    def metrics(self, batch: RolloutBatch, coef_1, kl, entropy, phi=None) -> dict[str, float]:
        """TRL's names: entropy, kl, and per loss type the clip ratios (the clipped types),
        cispo_clip_ratio (cispo) or vespo/phi_seq_mean (vespo); sapo has none of its own.

        Token means; at sequence level the ratio is one value per completion and its flags
        are means over completions, a completion without loss tokens (masked as truncated)
        counting with ratio 1, as in TRL."""
        c = self.cfg
        ratio, a = self.ops.to_numpy(coef_1), batch.advantages[batch.rows]
        if len(ratio) == 0:
            return {}
        if c.importance_sampling_level == "sequence":
            ratio, a = per_completion(ratio, batch.rows, batch.size, fill=1.0), batch.advantages
        out = {}
        if c.loss_type == "cispo":
            out["cispo_clip_ratio"] = float(((ratio > c.epsilon_upper) & (a > 0)).mean())
        elif c.loss_type == "vespo":
            out["vespo/phi_seq_mean"] = float(phi.mean())
        elif c.loss_type != "sapo":
            out.update(clip_metrics(ratio, a, c))
        if entropy is not None and len(entropy):
            out["entropy"] = float(np.mean(entropy))
        if kl is not None:
            out["kl"] = float(self.ops.to_numpy(kl).mean())
        return out


def clip_metrics(ratio: np.ndarray, advantages: np.ndarray, cfg) -> dict[str, float]:
    """TRL's clip_ratio/{low,high,region}_mean: the shares of ratios clipped where clipping takes effect."""
    low = (ratio < 1.0 - cfg.epsilon) & (advantages < 0)
    high = (ratio > 1.0 + cfg.epsilon_upper) & (advantages > 0)
    return {"clip_ratio/low_mean": float(low.mean()), "clip_ratio/high_mean": float(high.mean()),
            "clip_ratio/region_mean": float((low | high).mean())}


def per_completion(values: np.ndarray, rows: np.ndarray, n: int, fill: float) -> np.ndarray:
    """A per-token value that is constant within a completion, as one value per completion [n]
    (`fill` where a completion has no tokens)."""
    out = np.full(n, fill, dtype=values.dtype)
    out[rows] = values
    return out
