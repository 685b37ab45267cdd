"""Batches: padding, packing, token budgets, length grouping, determinism and exact resume."""

from __future__ import annotations

import numpy as np
import pytest

from mudpuppy.data import IGNORE_INDEX, Batcher, Example, collate, collate_packed, pack_sequences
from mudpuppy.data.batching import group_by_token_budget
from mudpuppy.data.packing import packing_efficiency
from mudpuppy.errors import MudpuppyError


def make_examples(lengths, seed=0, prompt=2):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        mask = np.ones(n, dtype=bool)
        mask[: min(prompt, n)] = False
        out.append(Example(rng.integers(3, 300, n).astype(np.int32), mask, f"x:{i}"))
    return out


LENGTHS = [5, 17, 3, 30, 12, 8, 21, 9, 14, 2, 26, 7, 11, 4, 19]
MODES = {
    "plain": {},
    "by_length": {"group_by_length": True},
    "token_budget": {"tokens_per_batch": 64},
    "packed": {"packing": True, "sequence_len": 32},
    "packed_budget": {"packing": True, "sequence_len": 32, "tokens_per_batch": 96},
}


def batcher(mode, seed=7, examples=None, mbs=3):
    return Batcher(examples or make_examples(LENGTHS), mbs, 0, seed, True, **MODES[mode])


def test_collate_shifts_labels_and_pads():
    ex = make_examples([4])[0]
    b = collate([ex, make_examples([2])[0]], pad_id=0)
    assert b.input_ids.shape == (2, 4) and b.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert b.labels[0].tolist() == [IGNORE_INDEX, ex.input_ids[2], ex.input_ids[3], IGNORE_INDEX]
    assert b.position_ids is None and b.segment_ids is None and not b.packed
    assert b.loss_tokens == 2 and b.real_tokens == 6


def test_packed_rows_reset_positions_and_never_cross_segments():
    exs = make_examples([4, 3, 5], prompt=0)
    b = collate_packed([[exs[0], exs[1]], [exs[2]]], pad_id=0)
    assert b.input_ids.shape == (2, 7)
    assert b.segment_ids.tolist() == [[1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 0, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 0, 1]]
    # The last token of each segment predicts nothing: no loss from one example into the next.
    assert b.labels[0, 3] == IGNORE_INDEX and b.labels[0, 6] == IGNORE_INDEX
    assert b.labels[0, :3].tolist() == exs[0].input_ids[1:].tolist()
    assert b.loss_tokens == collate(exs, 0).loss_tokens
    assert b.real_tokens == 12


def test_pack_sequences_fits_rows_and_uses_every_example_once():
    rows = pack_sequences(LENGTHS, 32)
    assert sorted(i for row in rows for i in row) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in row) <= 32 for row in rows)
    assert len(rows) == -(-sum(LENGTHS) // 32)     # optimal here: no row wasted
    eff, n = packing_efficiency(LENGTHS, 32)
    assert n == len(rows) and eff == pytest.approx(sum(LENGTHS) / (32 * n))


def test_pack_sequences_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="longer than the row length 8"):
        pack_sequences([3, 9], 8)


def test_token_budget_batches_stay_within_budget_and_group_by_length():
    batches = group_by_token_budget(LENGTHS, 64, seed=1)
    assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))
    for b in batches:
        assert len(b) * max(LENGTHS[i] for i in b) <= 64
    widths = [max(LENGTHS[i] for i in b) for b in batches]
    assert widths == sorted(widths)               # formed in length order
    assert len(batches[0]) > len(batches[-1])     # short examples many to a batch, long ones few


def test_token_budget_refuses_examples_longer_than_the_budget():
    with pytest.raises(ValueError, match="longer than tokens_per_batch=16"):
        group_by_token_budget([3, 20], 16, seed=0)


@pytest.mark.parametrize("mode", list(MODES))
def test_an_epoch_covers_every_token_once(mode):
    exs = make_examples(LENGTHS)
    b = batcher(mode, examples=exs)
    seen = []
    for _ in range(b.batches_per_epoch):
        batch = b.next_batch()
        if mode.startswith("token"):
            assert batch.input_ids.size <= 64
        if mode.startswith("packed"):
            assert batch.input_ids.shape[1] <= 32 and batch.packed
        for row in range(batch.input_ids.shape[0]):
            real = batch.attention_mask[row].astype(bool)
            seen += batch.input_ids[row][real].tolist()
    assert b.epoch == 0
    assert sorted(seen) == sorted(t for e in exs for t in e.input_ids.tolist())
    assert sum(len(e) for e in exs) == len(seen)


@pytest.mark.parametrize("mode", list(MODES))
def test_same_seed_same_batches_other_seed_other_order(mode):
    def run(seed):
        b = batcher(mode, seed=seed)
        return [b.next_batch().input_ids.tolist() for _ in range(2 * b.batches_per_epoch)]

    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize("mode", list(MODES))
def test_resume_from_state_gives_exactly_the_remaining_batches(mode):
    straight = batcher(mode)
    expected = [straight.next_batch() for _ in range(3 * straight.batches_per_epoch)]
    for stop in (1, straight.batches_per_epoch, straight.batches_per_epoch + 2):
        first = batcher(mode)
        for _ in range(stop):
            first.next_batch()
        resumed = batcher(mode)
        resumed.load_state_dict(first.state_dict())
        for want in expected[stop:]:
            got = resumed.next_batch()
            assert np.array_equal(got.input_ids, want.input_ids) and np.array_equal(got.labels, want.labels)
            if want.packed:
                assert np.array_equal(got.segment_ids, want.segment_ids)


def test_each_epoch_reshuffles():
    b = batcher("packed")
    first = [b.next_batch().input_ids.tolist() for _ in range(b.batches_per_epoch)]
    second = [b.next_batch().input_ids.tolist() for _ in range(b.batches_per_epoch)]
    assert b.epoch == 1 and first != second


def test_plain_order_is_the_seeded_permutation():
    # The order the SFT recipe has always used: epoch e is permutation(seed + e), in micro-batches.
    exs = make_examples(LENGTHS)
    b = Batcher(exs, 4, 0, 5)
    order = np.random.default_rng(5).permutation(len(exs))
    assert np.array_equal(b.next_batch().input_ids, collate([exs[i] for i in order[:4]], 0).input_ids)
    assert b.batches_per_epoch == 4 and b.state_dict()["position"] == 4


def test_unshuffled_plain_batches_keep_file_order():
    exs = make_examples(LENGTHS)
    b = Batcher(exs, 5, 0, 1, shuffle=False)
    assert np.array_equal(b.next_batch().input_ids, collate(exs[:5], 0).input_ids)


def test_state_from_other_data_is_refused():
    state = batcher("packed").state_dict()
    other = Batcher(make_examples(LENGTHS[:-3]), 3, 0, 7, **MODES["packed"])
    with pytest.raises(MudpuppyError, match="cannot resume: the saved batch order does not match this data"):
        other.load_state_dict(state)
    legacy = {"epoch": 1, "position": 2, "seed": 7}     # states written before modes existed still load
    b = batcher("plain")
    b.load_state_dict(legacy)
    assert (b.epoch, b.position) == (1, 2)


def test_packed_batches_per_epoch_follow_rows():
    b = batcher("packed", mbs=2)
    rows = pack_sequences(LENGTHS, 32)
    assert b.batches_per_epoch == -(-len(rows) // 2)
    b = batcher("packed_budget")
    assert b.batches_per_epoch == -(-len(rows) // 3)


def test_from_config(make_cfg, tmp_path):
    cfg = make_cfg([tmp_path / "x.jsonl"], packing=True, sequence_len=32, training={"micro_batch_size": 2})
    b = Batcher.from_config(make_examples(LENGTHS), cfg, pad_id=0)
    assert b.mode == "packed" and b.seed == 3 and b._per_batch == 2
    cfg = make_cfg([tmp_path / "x.jsonl"], tokens_per_batch=64, sequence_len=32)
    assert Batcher.from_config(make_examples(LENGTHS), cfg, 0).mode == "token_budget"


def test_packing_needs_a_row_length():
    with pytest.raises(ValueError, match="packing needs sequence_len"):
        Batcher(make_examples([3]), 1, 0, 0, packing=True)
