"""Reward models and process reward models: a scalar head on the base model, trained through the protocol.

Supports: `method: rm` with a sequence-classification head (one score per
sequence, read at its last non-padding token, as transformers reads it),
trained with the Bradley-Terry loss on preference pairs or with mean squared
error on {"text", "label"} data; `method: prm` with a token-classification
head (step correct / wrong) trained with cross-entropy at the last token of
each step, reporting step accuracy. LoRA/DoRA (the new head trains in full
and is saved with the adapter) or full fine-tuning; every loop feature SFT
has. The saved output loads with plain transformers (+ PEFT for adapters):
AutoModelForSequenceClassification / AutoModelForTokenClassification.

Does not support: margins or reward centring terms, several scores per
sequence, packing. `mudpuppy score` prints a trained model's scores.
"""

from __future__ import annotations

import numpy as np

from ..data import PairExample
from ..data.pairs import collate_items, collate_steps, pair_items, scored_items
from ..errors import DataError
from .runner import Recipe, run_recipe

HEADS = {"rm": "sequence_classification", "prm": "token_classification"}


# --------------------------------------------------------------------------- the losses

def bradley_terry_loss(ops, chosen_scores, rejected_scores):
    """-log σ(r_chosen - r_rejected) per pair: the chosen answer should score higher."""
    return -ops.log_sigmoid(chosen_scores - rejected_scores)


def squared_error(ops, scores, targets):
    return (scores - targets) ** 2


def step_cross_entropy(ops, logits, labels: np.ndarray):
    """Per step: -log p(label) under the head's two classes (0 wrong, 1 right)."""
    return -ops.pick(ops.log_softmax(logits), labels.astype(np.int64))


# --------------------------------------------------------------------------- objectives

class RewardObjective:
    """Bradley-Terry on pair batches (two roles), squared error on scored batches (one role)."""

    def __init__(self, backend, loss: str):
        self.backend, self.ops = backend, backend.ops
        self.accuracy_name = "reward_accuracy" if loss == "bradley_terry" else None

    def count(self, batch) -> int:
        return batch.size

    def __call__(self, handle, batch, grad: bool = True):
        ops, n = self.ops, batch.size
        scores = self.backend.sequence_scores(handle, batch.batch, grad)
        if batch.roles == 2:
            chosen, rejected = scores[:n], scores[n:]
            total = ops.sum(bradley_terry_loss(ops, chosen, rejected))
            c, r = ops.to_numpy(chosen), ops.to_numpy(rejected)
            return total, {"reward_chosen": float(c.mean()), "reward_rejected": float(r.mean()),
                           "reward_margin": float((c - r).mean()), "reward_accuracy": float((c > r).mean())}
        errors = squared_error(ops, scores, ops.from_numpy(batch.labels))
        return ops.sum(errors), {"mse": float(ops.to_numpy(errors).mean()),
                                 "score_mean": float(ops.to_numpy(scores).mean())}


class StepObjective:
    """PRM: cross-entropy per labelled step, averaged over the steps of the whole step."""

    accuracy_name = "step_accuracy"

    def __init__(self, backend):
        self.backend, self.ops = backend, backend.ops

    def count(self, batch) -> int:
        return len(batch.labels)

    def __call__(self, handle, batch, grad: bool = True):
        logits = self.backend.token_scores(handle, batch.batch, grad)
        losses = step_cross_entropy(self.ops, logits, batch.labels)
        predicted = self.ops.to_numpy(logits).argmax(axis=-1)
        return self.ops.sum(losses), {"step_accuracy": float((predicted == batch.labels).mean())}


# --------------------------------------------------------------------------- the recipes

def reward_loss_for(cfg, formats: set[str], where: str) -> str:
    """The loss the config asks for, checked against the data's format before any model loads."""
    if len(formats) > 1:
        raise DataError(where, None, "method rm: the datasets mix preference pairs and {text, label} scores; "
                                     "train on one kind at a time")
    fmt = formats.pop()
    natural = "bradley_terry" if fmt == "preference" else "mse"
    loss = cfg.reward.loss
    if loss not in ("auto", natural):
        wants = "preference pairs {prompt, chosen, rejected}" if loss == "bradley_terry" else "{text, label} data"
        raise DataError(where, None, f"reward.loss {loss} needs {wants}, but the data is {fmt}; "
                                     f"set reward.loss: auto (or {natural})")
    return natural


def run_reward(cfg, backend, overwrite: bool = False, echo=print, callbacks=()):
    if cfg.method == "prm":
        recipe = Recipe(head=HEADS["prm"], bad_input=cfg.reward.bad_pairs, make_items=lambda t, v: (t, v),
                        collate=collate_steps, objective=StepObjective(backend),
                        describe="process reward model (step classification)")
        return run_recipe(cfg, backend, recipe, overwrite=overwrite, echo=echo, callbacks=callbacks)

    objective = RewardObjective(backend, "bradley_terry")

    def check(loaded) -> None:
        formats = {ds.format for ds in loaded.train + loaded.val}
        loss = reward_loss_for(cfg, formats, loaded.train[0].name)
        objective.accuracy_name = "reward_accuracy" if loss == "bradley_terry" else None
        recipe.describe = f"reward model ({loss.replace('_', '-')})"

    def make_items(train, val):
        if isinstance(train[0], PairExample):
            return pair_items(train), pair_items(val)
        return scored_items(train), scored_items(val)

    recipe = Recipe(head=HEADS["rm"], bad_input=cfg.reward.bad_pairs, make_items=make_items,
                    collate=collate_items, objective=objective, check=check)
    return run_recipe(cfg, backend, recipe, overwrite=overwrite, echo=echo, callbacks=callbacks)
