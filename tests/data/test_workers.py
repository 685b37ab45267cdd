"""The tokenizing workers: results in order, and TOKENIZERS_PARALLELISM as it was however the pool ends."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from mudpuppy.data import load_data, pipeline, prepare_data, workers
from mudpuppy.errors import DataError

from .conftest import SAMPLES

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
        Pipe = staticmethod(multiprocessing.Pipe)

        def Process(self, *args, **kwargs):
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


# --------------------------------------------------------------------------- a worker that dies

DEADLINE = 60   # seconds: a dead worker's chunk waited for (the old Pool's hang) fails the test instead


@contextmanager
def deadline(seconds: int = DEADLINE):
    """SIGALRM interrupts the main thread's wait, so a regression fails here instead of hanging the suite."""
    def expired(signum, frame):
        raise TimeoutError(f"still waiting after {seconds} s: the dead worker's chunk is waited for")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def dies_on(tokenizer, job):
    """As the OOM killer ends a worker: SIGKILL, nothing sent back."""
    if job == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    return tokenizer + str(job)


def test_a_worker_killed_by_sigkill_fails_fast_naming_it_and_its_job(before):
    jobs = [1, 2, 3, "die", 4, 5, 6, 7]
    started = time.monotonic()
    with deadline(), pytest.raises(workers.WorkerDied) as died:
        list(workers.ordered_map(dies_on, jobs, "t", 2, where=lambda job: f"the chunk {job!r}"))
    message = str(died.value)
    assert "a tokenizing worker process died" in message and "SIGKILL" in message, message
    assert "the chunk 'die'" in message and "data.num_proc: 1" in message and "memory" in message, message
    assert time.monotonic() - started < 30 and os.environ.get(NAME) == before
    # The next pool is a fresh one: nothing of the broken one is reused.
    assert list(workers.ordered_map(dies_on, range(5), "t", 2)) == [f"t{i}" for i in range(5)]


def test_a_spawned_worker_that_dies_fails_fast_too():
    # From a thread the workers are spawned (3dcc329): the same error, no hang. SIGALRM reaches the main
    # thread only, so the thread is given a deadline to finish in.
    import threading

    got = {}

    def consume():
        try:
            got["r"] = list(workers.ordered_map(dies_on, [1, "die", 2, 3, 4], "t", 2, where=str))
        except workers.WorkerDied as exc:
            got["error"] = str(exc)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    assert not thread.is_alive(), "still waiting for the dead worker's chunk"
    assert "SIGKILL" in got["error"] and "on die" in got["error"], got


def test_a_worker_exiting_with_a_code_is_named_by_its_code():
    with deadline(), pytest.raises(workers.WorkerDied, match=r"exit code 3"):
        list(workers.ordered_map(exits_on, [1, "exit", 2, 3], "t", 2))


def exits_on(tokenizer, job):
    if job == "exit":
        os._exit(3)
    return tokenizer + str(job)


DEADLY_LINE = 777      # the record whose chunk kills its worker


def dies_on_a_line(tokenizer, job):
    """pipeline.tokenize_chunk, except that the worker handed DEADLY_LINE's chunk is SIGKILLed (as by the OOM
    killer) before it sends anything back."""
    chunk = job[1]
    lines = [n for n, _ in chunk.lines] if hasattr(chunk, "lines") else [r.line for r in chunk]
    if DEADLY_LINE in lines:
        os.kill(os.getpid(), signal.SIGKILL)
    return REAL_TOKENIZE_CHUNK(tokenizer, job)


REAL_TOKENIZE_CHUNK = pipeline.tokenize_chunk


@pytest.mark.parametrize("cached", [True, False])
def test_preprocessing_fails_fast_when_a_worker_dies_and_leaves_no_store_to_trust(make_cfg, write, tokenizer_dir,
                                                                                   monkeypatch, cached):
    """A streamed file (raw lines to the workers) and a held one, two workers: the chunk holding line 777 kills
    its worker. One error names the file and the chunk's lines; no cache entry (or staging or scratch folder)
    is left, and the next run tokenizes afresh, the same tokens as one process."""
    from transformers import AutoTokenizer

    rows = [json.loads(line) for line in (SAMPLES / "smart_home_train.jsonl").read_text().splitlines()] * 3
    big = write("big_chats.jsonl", rows)                # over stream.KEEP: streamed, sent as raw lines
    monkeypatch.setattr(pipeline, "CHUNK", 100)
    cfg = make_cfg([SAMPLES / "smart_home_train.jsonl", big], num_proc=2)
    loaded = load_data(cfg, "sft")
    assert loaded.train[1].stream is not None and loaded.train[0].stream is None
    root = Path(cfg.data.cache_dir)

    def prepare(num_proc=2, cache=cached):
        cfg.data.num_proc = num_proc
        return prepare_data(cfg, AutoTokenizer.from_pretrained(str(tokenizer_dir)), load_data(cfg, "sft"),
                            use_cache=cache, write_cache=cache)

    monkeypatch.setattr(pipeline, "tokenize_chunk", dies_on_a_line)
    with deadline(), pytest.raises(workers.WorkerDied) as died:
        prepare()
    message = str(died.value)
    assert "tokenizing worker process died" in message and "SIGKILL" in message, message
    assert f"{big}, lines 701-800" in message and "data.num_proc: 1" in message, message
    # Nothing a later run could take for a store: no entry, no staging folder, no scratch store, no claim.
    assert not [p for p in root.rglob("*") if p.name != ".scratch"], sorted(root.rglob("*"))

    monkeypatch.setattr(pipeline, "tokenize_chunk", REAL_TOKENIZE_CHUNK)
    again, one = prepare(), prepare(num_proc=1, cache=False)
    assert again.report.cache == ("written" if cached else "off") and len(again.train) == len(one.train) == 480 * 4
    for a, b in zip(again.train, one.train):
        assert a.source == b.source and np.array_equal(a.input_ids, b.input_ids)
