"""Online DPO's pieces: ranking each prompt's two completions (numpy) and DPO's loss on the pair (ArrayOps).

Online DPO runs on GRPO's recipe (grpo.py) and rollouts (rollout.py), with two
completions a prompt kept side by side in one micro-batch. It follows TRL 1.16's
experimental OnlineDPOTrainer (`training_step`), checked in
tests/training/test_online_dpo_oracle.py:

- the rewards are weighted and summed with a None counted as 0 (an unscorable
  completion scores 0, as TRL's nansum gives); missing_eos_penalty is taken off
  a completion that ended without a stop token;
- the first completion is chosen when its reward is >= the second's (a tie goes
  to the first);
- the loss is DPO's (preference.dpo_loss) or IPO's on summed log-probs
  (preference.ipo_loss with unit lengths), at temperature 1 whatever the sampling
  temperature, against the reference (the adapter off), averaged over the pairs.

The pair's roles travel as the advantages: +1 chosen, -1 rejected.
"""

from __future__ import annotations

import numpy as np

from ..backends.routing import with_router_aux
from .grpo_loss import Advantages, RolloutBatch, weighted_rewards
from .preference import dpo_loss, ipo_loss, reward_metrics


def pair_preferences(rewards_per_func: np.ndarray, weights: np.ndarray, truncated: np.ndarray,
                     missing_eos_penalty: float | None = None) -> Advantages:
    """+1 for the chosen and -1 for the rejected completion of each consecutive pair."""
    rewards, _ = weighted_rewards(rewards_per_func, weights)
    scored = np.nan_to_num(rewards, nan=0.0)
    if missing_eos_penalty is not None:
        scored = scored - missing_eos_penalty * np.asarray(truncated, dtype=np.float64)
    first, second = scored[0::2], scored[1::2]
    first_wins = first >= second
    roles = np.stack([np.where(first_wins, 1.0, -1.0), np.where(first_wins, -1.0, 1.0)], axis=1).reshape(-1)
    return Advantages(roles.astype(np.float32), rewards, np.repeat(first == second, 2))


class OnlineDpoObjective:
    """The trainer's objective (protocol.Objective) for micro-batches of whole pairs (RolloutBatch)."""

    def __init__(self, backend, cfg):
        self.backend, self.ops, self.cfg = backend, backend.ops, cfg

    def count(self, batch: RolloutBatch) -> float:
        """TRL averages over a micro-batch's pairs."""
        return batch.size / 2

    def __call__(self, handle, batch: RolloutBatch, grad: bool = True):
        ops, c, n = self.ops, self.cfg, batch.size
        logps, _, aux = self.backend.token_logprobs(handle, batch.batch, grad=grad, router_aux=True)
        seq = ops.row_sum(logps, batch.rows, n)
        ref = ops.from_numpy(np.bincount(batch.rows, weights=batch.ref_logps, minlength=n).astype(np.float32))
        chosen, rejected = np.nonzero(batch.advantages > 0)[0], np.nonzero(batch.advantages < 0)[0]
        pair = (ops.take(seq, chosen), ops.take(seq, rejected), ops.take(ref, chosen), ops.take(ref, rejected))
        if c.loss_type == "sigmoid":
            losses, r_chosen, r_rejected = dpo_loss(ops, *pair, c.beta)
        else:
            losses, r_chosen, r_rejected = ipo_loss(ops, *pair, 1.0, 1.0, c.beta)
        total, aux_metric = with_router_aux(ops, ops.sum(losses), aux, self.count(batch))
        return total, {**reward_metrics(ops.to_numpy(r_chosen), ops.to_numpy(r_rejected)), **aux_metric}
