"""The tokenizing workers: results in order, and TOKENIZERS_PARALLELISM as it was however the pool ends."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from mudpuppy.data import workers
from mudpuppy.errors import DataError

NAME = "TOKENIZERS_PARALLELISM"


def double(tokenizer, job):
    if job == "bad":
        raise DataError("d.jsonl", 7, "a bad record")
    return tokenizer + str(job * 2)


@pytest.fixture(params=[None, "true"])
def before(request, monkeypatch):
    if request.param is None:
        monkeypatch.delenv(NAME, raising=False)
    else:
        monkeypatch.setenv(NAME, request.param)
    return request.param


def test_results_come_in_order_and_the_variable_is_restored(before):
    assert list(workers.ordered_map(double, range(20), "t", 2)) == [f"t{2 * i}" for i in range(20)]
    assert os.environ.get(NAME) == before


def test_a_worker_error_is_raised_with_its_place_and_the_variable_restored(before):
    with pytest.raises(DataError, match="d.jsonl:7: a bad record"):
        list(workers.ordered_map(double, [1, 2, "bad", 3], "t", 2))
    assert os.environ.get(NAME) == before


def test_a_consumer_that_stops_early_restores_the_variable(before):
    results = workers.ordered_map(double, range(100), "t", 2)
    assert next(results) == "t0" and os.environ.get(NAME) == "false"
    results.close()
    assert os.environ.get(NAME) == before


def test_a_pool_that_fails_to_start_restores_the_variable(before, monkeypatch):
    class Broken:
        def Pool(self, *args, **kwargs):
            raise OSError("no processes left")

    monkeypatch.setattr(multiprocessing, "get_context", lambda method: Broken())
    with pytest.raises(OSError, match="no processes left"):
        list(workers.ordered_map(double, range(4), "t", 2))
    assert os.environ.get(NAME) == before


def test_workers_started_from_another_thread_are_spawned_not_forked(monkeypatch):
    # A fork from a thread copies locks other threads hold; in the full suite such workers segfaulted as
    # they started and the Pool forked them again without end. From the main thread: fork (cheap, shared
    # pages); from any other: spawn, with the same results in the same order.
    import threading

    methods = []
    real = multiprocessing.get_context

    def recording(method=None):
        methods.append(method)
        return real(method)

    monkeypatch.setattr(workers.multiprocessing, "get_context", recording)
    got = {}
    thread = threading.Thread(target=lambda: got.setdefault("r", list(workers.ordered_map(double, range(6), "t", 2))))
    thread.start()
    thread.join()
    assert got["r"] == [f"t{2 * i}" for i in range(6)] and methods == ["spawn"]
    assert list(workers.ordered_map(double, range(3), "t", 2)) == ["t0", "t2", "t4"] and methods[-1] == "fork"
