"""shared.py in one process: two ranks as threads, their collectives a barrier, so what each rank maps can be
looked at directly (tests/distributed/test_shared_store.py runs the real `--nproc 2`)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from mudpuppy.data import load_data, prepare_sft_data
from mudpuppy.data.shared import prepare_shared
from mudpuppy.distributed import Ranks
from mudpuppy.errors import DataError, MudpuppyError

from .conftest import SAMPLES


def thread_ranks(world: int) -> list[Ranks]:
    """`world` Ranks on one machine whose gather is an exchange through a barrier."""
    barrier, slots = threading.Barrier(world), [None] * world

    def make(rank: int) -> Ranks:
        def gather(obj):
            slots[rank] = obj
            barrier.wait()
            out = list(slots)
            barrier.wait()          # nobody overwrites a slot before every rank has read them
            return out
        return Ranks(rank, world, rank, world, barrier=barrier.wait, gather=gather)

    return [make(r) for r in range(world)]


def run_ranks(world: int, fn):
    """fn(ranks) on `world` threads; each one's result or exception."""
    results = [None] * world

    def body(r, ranks):
        try:
            results[r] = fn(ranks)
        except Exception as exc:    # noqa: BLE001 - handed to the test
            results[r] = exc

    threads = [threading.Thread(target=body, args=(r, ranks)) for r, ranks in enumerate(thread_ranks(world))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_every_rank_maps_the_store_rank_0_wrote_and_its_names_go_after(make_cfg, tok, tmp_path):
    cfg = make_cfg([{"path": str(SAMPLES / "smart_home_train.jsonl"), "num_samples": 60}], val_set_size=8)
    loaded = load_data(cfg)
    calls = []

    def here():
        calls.append(threading.get_ident())
        from mudpuppy.data.pipeline import prepare_store
        prepared, folder = prepare_store(cfg, tok, loaded, True, None, tmp_path / "cache", False, [], keep_scratch=True)
        return prepared, folder, True

    results = run_ranks(2, lambda ranks: prepare_shared(ranks, here))
    assert len(calls) == 1                                  # local rank 0 alone prepared
    zero, one = results
    maps = [r.train.store.arrays["tokens"] for r in results]
    assert all(isinstance(m, np.memmap) for m in maps)      # no rank holds a private copy of the tokens
    assert Path(maps[0].filename).parent == Path(maps[1].filename).parent     # the same files
    assert list((tmp_path / "cache" / ".scratch").iterdir()) == []           # removed once both mapped
    alone = prepare_sft_data(cfg, tok, load_data(cfg))
    for got in (zero, one):
        assert [e.source for e in got.train] == [e.source for e in alone.train]
        assert [e.source for e in got.val] == [e.source for e in alone.val]
        np.testing.assert_array_equal(got.train[5].input_ids, alone.train[5].input_ids)
        assert got.val_records == alone.val_records and got.report.mapped_by == 2
    assert one.report.train_examples == zero.report.train_examples == len(alone.train)


def test_an_error_on_rank_0_is_raised_on_every_rank(make_cfg, tok):
    def here():
        raise DataError("d.jsonl", 3, "bad record")

    first, second = run_ranks(2, lambda ranks: prepare_shared(ranks, here))
    assert isinstance(first, DataError)
    assert isinstance(second, MudpuppyError) and str(second) == str(first)
    with pytest.raises(MudpuppyError, match="d.jsonl:3"):
        raise second
