"""Examples to one numpy batch: padded rows, or packed rows that hold several examples."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .examples import Example

IGNORE_INDEX = -100


@dataclass
class Batch:
    input_ids: np.ndarray        # int64 [B, T]
    labels: np.ndarray           # int64 [B, T]; IGNORE_INDEX where no loss (already aligned: label t is the target for input t)
    attention_mask: np.ndarray   # int64 [B, T]; 1 for real tokens
    # Packed rows only (None otherwise): each token's position within its own
    # example, and which example of the row it belongs to (1, 2, ...; 0 = padding).
    # A backend must keep tokens of different segments from attending to each other.
    position_ids: np.ndarray | None = None   # int64 [B, T]
    segment_ids: np.ndarray | None = None    # int64 [B, T]
    # Vision-language rows only (None otherwise): each row's image files, in the order of its image tokens.
    images: list[tuple[str, ...]] | None = None

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def loss_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def packed(self) -> bool:
        return self.segment_ids is not None


def shifted_labels(ex: Example) -> np.ndarray:
    """Position t predicts token t+1; the target carries loss when token t+1 is trained.
    The last token predicts nothing: in a packed row that keeps the loss from crossing
    into the next example."""
    labels = np.full(len(ex), IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = np.where(ex.loss_mask[1:], ex.input_ids[1:], IGNORE_INDEX)
    return labels


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
        labels[row, :n] = shifted_labels(ex)
    images = [getattr(ex, "images", ()) for ex in examples]
    return Batch(ids, labels, attn, images=images if any(images) else None)


def collate_packed(rows: list[list[Example]], pad_id: int) -> Batch:
    """Each row is several examples end to end, padded to the fullest row of the batch."""
    width = max(sum(len(e) for e in row) for row in rows)
    shape = (len(rows), width)
    ids = np.full(shape, pad_id, dtype=np.int64)
    labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
    attn = np.zeros(shape, dtype=np.int64)
    positions = np.zeros(shape, dtype=np.int64)
    segments = np.zeros(shape, dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for seg, ex in enumerate(row, start=1):
            n = len(ex)
            ids[r, at : at + n] = ex.input_ids
            labels[r, at : at + n] = shifted_labels(ex)
            attn[r, at : at + n] = 1
            positions[r, at : at + n] = np.arange(n)
            segments[r, at : at + n] = seg
            at += n
        # Padding is a segment of its own (id 0), attending only to itself, so no
        # attention row is empty; its positions count from 0 like any segment.
        positions[r, at:] = np.arange(width - at)
    return Batch(ids, labels, attn, positions, segments)
