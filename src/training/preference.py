"""Preference optimisation: DPO, IPO, SimPO, ORPO and KTO, each one formula over sequence log-probs.

Supports: preference pairs ({prompt, chosen, rejected}) for dpo, ipo, simpo
and orpo; unpaired {prompt, completion, label} data for kto; LoRA/DoRA (the
reference is the base model with the adapter switched off) or full
fine-tuning with `precompute_ref: true`; reference log-probs precomputed
once to halve the work per step; everything SFT's loop offers (accumulation,
schedules, checkpoints with exact resume, early stopping on held-out loss).
Logged per step: loss, chosen and rejected rewards, their margin and the
reward accuracy (KTO: the share of examples on the side of the KL baseline
their label asks for).

Does not support: packing (pairs batch as whole sequences), online
generation (see GRPO), a reference other than the starting weights.

The formulas follow TRL 1.16 (DPOTrainer sigmoid/ipo, CPOTrainer simpo,
ORPOTrainer, KTOTrainer) and are checked against it in
tests/training/test_preference_oracle.py; where we differ on purpose the
function says so. They use only `backend.ops` and arithmetic operators, so
the same code runs on torch tensors and MLX arrays.
"""

from __future__ import annotations

import math

import numpy as np

from ..backends.routing import with_router_aux
from ..data.pairs import collate_items, kto_items, pair_items, role_batch, with_reference
from .runner import Recipe, run_recipe

LN2 = math.log(2.0)


# --------------------------------------------------------------------------- the losses

def dpo_loss(ops, chosen, rejected, ref_chosen, ref_rejected, beta: float, label_smoothing: float = 0.0):
    """DPO's sigmoid loss per pair, and the implicit rewards β·log(π/π_ref).

    With label smoothing ε this is conservative DPO: the preference is taken
    as flipped with probability ε. (TRL 1.16 applies label_smoothing only to
    its robust/exo/aot losses, not to sigmoid; at ε = 0 the two agree.)
    """
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    z = beta * (chosen_ratio - rejected_ratio)
    losses = -(1.0 - label_smoothing) * ops.log_sigmoid(z) - label_smoothing * ops.log_sigmoid(-z)
    return losses, beta * ops.detach(chosen_ratio), beta * ops.detach(rejected_ratio)


def ipo_loss(ops, chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens, beta: float):
    """IPO: squared distance of the per-token log-ratio margin from 1/(2β).

    Log-ratios are divided by completion length, as TRL does (and as the IPO
    authors confirmed their results use), so β means the same for short and
    long answers.
    """
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    margin = chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens
    losses = (margin - 1.0 / (2.0 * beta)) ** 2
    return losses, beta * ops.detach(chosen_ratio), beta * ops.detach(rejected_ratio)


def simpo_loss(ops, chosen, rejected, chosen_tokens, rejected_tokens, beta: float, gamma: float,
               label_smoothing: float = 0.0):
    """SimPO: no reference; rewards are β times the mean log-prob per token, with a margin γ."""
    chosen_mean, rejected_mean = chosen / chosen_tokens, rejected / rejected_tokens
    z = beta * (chosen_mean - rejected_mean - gamma / beta)
    losses = -(1.0 - label_smoothing) * ops.log_sigmoid(z) - label_smoothing * ops.log_sigmoid(-z)
    return losses, beta * ops.detach(chosen_mean), beta * ops.detach(rejected_mean)


def orpo_loss(ops, chosen, rejected, chosen_tokens, rejected_tokens, lam: float):
    """ORPO's odds-ratio term per pair, -λ·log σ(log odds(chosen) - log odds(rejected)).

    Odds use the mean log-prob per token p: odds = p / (1 - p). The NLL term
    on the chosen answers is added by the objective. Rewards: λ·mean log-prob.
    """
    chosen_mean, rejected_mean = chosen / chosen_tokens, rejected / rejected_tokens
    log_odds = (chosen_mean - rejected_mean) - (log1mexp(ops, chosen_mean) - log1mexp(ops, rejected_mean))
    losses = -lam * ops.log_sigmoid(log_odds)
    return losses, lam * ops.detach(chosen_mean), lam * ops.detach(rejected_mean), ops.detach(log_odds)


def log1mexp(ops, x):
    """log(1 - exp(x)) for x < 0, switching formulas at -ln 2 to avoid cancellation (as TRL)."""
    return ops.where(x < -LN2, ops.log1p(-ops.exp(x)), ops.log(-ops.expm1(x)))


def kto_loss(ops, policy, reference, desirable, kl, beta: float, desirable_weight: float,
             undesirable_weight: float):
    """KTO per example: desirable ones pushed above the KL baseline, undesirable ones below.

    `kl` is the batch estimate from mismatched pairs, detached and clipped at
    0, as in TRL. Returns the losses and the rewards β·log(π/π_ref).
    """
    ratio = policy - reference
    up = desirable_weight * (1.0 - ops.sigmoid(beta * (ratio - kl)))
    down = undesirable_weight * (1.0 - ops.sigmoid(beta * (kl - ratio)))
    return ops.where(desirable, up, down), beta * ops.detach(ratio)


# --------------------------------------------------------------------------- the objective

class PreferenceObjective:
    """The trainer's objective (protocol.Objective) for one preference type; summed over items."""

    accuracy_name = "reward_accuracy"

    def __init__(self, backend, pref_cfg):
        self.backend, self.ops, self.cfg = backend, backend.ops, pref_cfg

    def count(self, batch) -> int:
        return batch.size

    def __call__(self, handle, batch, grad: bool = True):
        if self.cfg.type == "kto":
            return self.kto(handle, batch, grad)
        return self.pairs(handle, batch, grad)

    def reference(self, handle, batch):
        """Reference log-probs for every row: precomputed, or the adapter switched off now."""
        if batch.ref_logps is not None:
            return self.ops.from_numpy(batch.ref_logps)
        return self.backend.reference_logprobs(handle, batch.batch)

    def pairs(self, handle, batch, grad: bool):
        ops, c, n = self.ops, self.cfg, batch.size
        logps, tokens, aux = self.backend.sequence_logprobs(handle, batch.batch, grad, router_aux=True)
        lengths = ops.from_numpy(np.maximum(tokens, 1).astype(np.float32))
        chosen, rejected, n_chosen, n_rejected = logps[:n], logps[n:], lengths[:n], lengths[n:]
        extra = {}
        if c.type in ("dpo", "ipo"):
            ref = self.reference(handle, batch)
            ref_chosen, ref_rejected = ref[:n], ref[n:]
        if c.type == "dpo":
            losses, r_chosen, r_rejected = dpo_loss(ops, chosen, rejected, ref_chosen, ref_rejected,
                                                    c.beta, c.label_smoothing)
            total = ops.sum(losses)
        elif c.type == "ipo":
            losses, r_chosen, r_rejected = ipo_loss(ops, chosen, rejected, ref_chosen, ref_rejected,
                                                    n_chosen, n_rejected, c.beta)
            total = ops.sum(losses)
        elif c.type == "simpo":
            losses, r_chosen, r_rejected = simpo_loss(ops, chosen, rejected, n_chosen, n_rejected,
                                                      c.beta, c.gamma, c.label_smoothing)
            total = ops.sum(losses)
        else:
            losses, r_chosen, r_rejected, log_odds = orpo_loss(ops, chosen, rejected, n_chosen, n_rejected,
                                                               c.orpo_lambda)
            # NLL of the chosen answers, averaged per token over the batch (as TRL), counted once per pair.
            nll = -ops.sum(chosen) / float(max(int(tokens[:n].sum()), 1))
            total = nll * float(n) + ops.sum(losses)
            extra = {"nll": ops.to_float(nll), "log_odds": float(ops.to_numpy(log_odds).mean())}
        total, aux_metric = with_router_aux(ops, total, aux, n)
        return total, {**reward_metrics(ops.to_numpy(r_chosen), ops.to_numpy(r_rejected)), **extra, **aux_metric}

    def kto(self, handle, batch, grad: bool):
        ops, c, n = self.ops, self.cfg, batch.size
        policy, _, aux = self.backend.sequence_logprobs(handle, role_batch(batch, 0), grad, router_aux=True)
        # The KL baseline carries no gradient (as in TRL): the policy's side needs none either.
        policy_kl, _ = self.backend.sequence_logprobs(handle, role_batch(batch, 1), grad=False)
        ref = self.reference(handle, batch)
        kl = ops.clip(ops.mean(policy_kl - ref[n:]), low=0.0)
        desirable = batch.labels > 0.5
        losses, rewards = kto_loss(ops, policy, ref[:n], ops.from_numpy(desirable), ops.detach(kl),
                                   c.beta, c.desirable_weight, c.undesirable_weight)
        kl_value = ops.to_float(kl)
        r = ops.to_numpy(rewards)
        metrics = {"kl": kl_value, "reward_accuracy": float(((r > c.beta * kl_value) == desirable).mean())}
        if desirable.any():
            metrics["reward_chosen"] = float(r[desirable].mean())
        if (~desirable).any():
            metrics["reward_rejected"] = float(r[~desirable].mean())
        if desirable.any() and (~desirable).any():
            metrics["reward_margin"] = metrics["reward_chosen"] - metrics["reward_rejected"]
        total, aux_metric = with_router_aux(ops, ops.sum(losses), aux, n)
        return total, {**metrics, **aux_metric}


def reward_metrics(chosen: np.ndarray, rejected: np.ndarray) -> dict[str, float]:
    return {"reward_chosen": float(chosen.mean()), "reward_rejected": float(rejected.mean()),
            "reward_margin": float((chosen - rejected).mean()),
            "reward_accuracy": float((chosen > rejected).mean())}


# --------------------------------------------------------------------------- reference log-probs

def precompute_reference(backend, handle, items: list, batch_size: int, pad_id: int) -> list:
    """Items carrying their reference log-probs, computed once (adapter off, or untrained weights)."""
    if not items:
        return items
    roles = len(items[0].sequences)
    ref = np.zeros((len(items), roles), dtype=np.float32)
    for start in range(0, len(items), batch_size):
        batch = collate_items(items[start : start + batch_size], pad_id)
        values = backend.ops.to_numpy(backend.reference_logprobs(handle, batch.batch))
        ref[start : start + batch.size] = values.reshape(roles, batch.size).T
    return with_reference(items, ref)


# --------------------------------------------------------------------------- the recipe

def run_preference(cfg, backend, overwrite: bool = False, echo=print, callbacks=()):
    pref = cfg.preference
    seq_len = cfg.data.sequence_len

    def make_items(train, val):
        if pref.type == "kto":
            return kto_items(train, seq_len), kto_items(val, seq_len)
        return pair_items(train), pair_items(val)

    def prepare(impl, handle, train, val):
        if not (pref.precompute_ref and pref.needs_reference):
            return train, val
        pad, size = handle.tokenizer.pad_token_id, cfg.eval.batch_size
        echo(f"reference log-probs: computing for {len(train) + len(val)} examples once")
        return (precompute_reference(impl, handle, train, size, pad),
                precompute_reference(impl, handle, val, size, pad))

    recipe = Recipe(head=None, bad_input=pref.bad_pairs, make_items=make_items, collate=collate_items,
                    objective=PreferenceObjective(backend, pref), prepare=prepare, describe=describe(pref))
    return run_recipe(cfg, backend, recipe, overwrite=overwrite, echo=echo, callbacks=callbacks)


def describe(pref) -> str:
    knobs = {"orpo": f"lambda {pref.orpo_lambda}", "simpo": f"beta {pref.beta}, gamma {pref.gamma}"}
    text = f"{pref.type} ({knobs.get(pref.type, f'beta {pref.beta}')}"
    if pref.needs_reference:
        text += ", reference precomputed" if pref.precompute_ref else ", reference: adapter off"
    return text + ")"
