"""Examples to padded numpy batches, in a deterministic, resumable order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tokenize import Example

IGNORE_INDEX = -100


@dataclass
class Batch:
    input_ids: np.ndarray        # int64 [B, T]
    labels: np.ndarray           # int64 [B, T]; IGNORE_INDEX where no loss (already aligned: label t is the target for input t)
    attention_mask: np.ndarray   # int64 [B, T]; 1 for real tokens

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def loss_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def collate(examples: list[Example], pad_id: int) -> Batch:
    """Right-pad to the longest example; labels are next-token targets already shifted."""
    width = max(len(e) for e in examples)
    ids = np.full((len(examples), width), pad_id, dtype=np.int64)
    labels = np.full((len(examples), width), IGNORE_INDEX, dtype=np.int64)
    attn = np.zeros((len(examples), width), dtype=np.int64)
    for row, ex in enumerate(examples):
        n = len(ex)
        ids[row, :n] = ex.input_ids
        attn[row, :n] = 1
        # Position t predicts token t+1; the target carries loss when token t+1 is trained.
        targets = np.where(ex.loss_mask[1:], ex.input_ids[1:], IGNORE_INDEX)
        labels[row, : n - 1] = targets
    return Batch(ids, labels, attn)


class Batcher:
    """Yields micro-batches epoch after epoch; its position is plain state for exact resume.

    The order of epoch e is a permutation drawn from ``seed + e`` alone, so a
    resumed run sees exactly the batches an uninterrupted one would.
    """

    def __init__(self, examples: list[Example], micro_batch_size: int, pad_id: int, seed: int, shuffle: bool = True):
        if not examples:
            raise ValueError("no examples to batch")
        self.examples = examples
        self.micro_batch_size = micro_batch_size
        self.pad_id = pad_id
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._order_for(0)

    @property
    def batches_per_epoch(self) -> int:
        return -(-len(self.examples) // self.micro_batch_size)

    def _order_for(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.examples))
        return np.random.default_rng(self.seed + epoch).permutation(len(self.examples))

    def next_batch(self) -> Batch:
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._order_for(self.epoch)
        idx = self._order[self.position : self.position + self.micro_batch_size]
        self.position += len(idx)
        return collate([self.examples[i] for i in idx], self.pad_id)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._order_for(self.epoch)


def fixed_batches(examples: list[Example], batch_size: int, pad_id: int) -> list[Batch]:
    """Evaluation batches in file order, longest-first within nothing: simple and reproducible."""
    return [collate(examples[i : i + batch_size], pad_id) for i in range(0, len(examples), batch_size)]
