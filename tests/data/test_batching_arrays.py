"""Packing and token-budget batching on arrays give the rows and batches the list-based walk gave,
and the report's epoch fill counts what collating every batch counts."""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np
import pytest

from mudpuppy.data import Batcher, Example, pack_sequences
from mudpuppy.data import batching
from mudpuppy.data.batching import _length_order, group_by_token_budget


def reference_pack(lengths, capacity):
    """Best-fit decreasing as a sorted list of (room, row): the definition the arrays must match."""
    rows, free = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        at = bisect_left(free, (n, -1))
        room, row = free.pop(at) if at < len(free) else (capacity, len(rows))
        if row == len(rows):
            rows.append([])
        rows[row].append(i)
        if room - n > 0:
            insort(free, (room - n, row))
    return rows


def reference_budget(lengths, budget, seed):
    batches, current = [], []
    for i in _length_order(lengths, seed).tolist():
        if current and (len(current) + 1) * lengths[i] > budget:
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


@pytest.mark.parametrize("seed", range(40))
def test_rows_and_budget_batches_match_the_list_walk(seed):
    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(8, 200))
    lengths = rng.integers(1, capacity + 1, int(rng.integers(0, 400))).tolist()
    assert pack_sequences(lengths, capacity) == reference_pack(lengths, capacity)
    if lengths:
        budget = int(rng.integers(capacity, 4 * capacity))
        assert group_by_token_budget(lengths, budget, seed) == reference_budget(lengths, budget, seed)


MODES = [{}, {"group_by_length": True}, {"tokens_per_batch": 64}, {"packing": True, "sequence_len": 32},
         {"packing": True, "sequence_len": 32, "tokens_per_batch": 96}]


@pytest.mark.parametrize("block", [1, 7, 1 << 16])
@pytest.mark.parametrize("mode", range(len(MODES)))
def test_epoch_fill_counts_what_collated_batches_hold(monkeypatch, mode, block):
    monkeypatch.setattr(batching, "FILL_BLOCK", block)
    rng = np.random.default_rng(mode)
    exs = [Example(np.ones(n, np.int32), np.ones(n, bool), "x") for n in rng.integers(1, 33, 101)]
    # Unshuffled, the epoch's batches are the units in order, which is what epoch_fill counts.
    b = Batcher(exs, 3, 0, 5, False, **MODES[mode])
    real, slots, n = b.epoch_fill()
    batches = [b.next_batch() for _ in range(b.batches_per_epoch)]
    assert n == len(batches) and b.epoch == 0
    assert real == sum(x.real_tokens for x in batches)
    assert slots == sum(x.input_ids.size for x in batches)
