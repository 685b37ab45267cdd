"""Worker processes that tokenize chunks of records, results in submission order.

The tokenizer reaches the workers once, not with every chunk: where `fork`
exists (Linux) the workers inherit it from the parent's memory; elsewhere
(macOS, Windows: `spawn`) it is pickled once into each worker's initializer.
At most two chunks per worker are in flight, so a reader that is faster than
the tokenizer never piles records up in memory, and results come back in the
order the chunks went out: the output is the same for any number of workers.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from ..errors import DataError

IN_FLIGHT = 2          # chunks per worker queued or running
_STATE: dict = {}      # the worker's tokenizer: inherited through fork, or set by _init under spawn


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container or taskset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                      # macOS and Windows have no affinity mask
        return os.cpu_count() or 1


def _init(blob: bytes) -> None:
    _STATE["tokenizer"] = pickle.loads(blob)


def _run(fn: Callable, job):
    # A DataError does not survive pickling (its __init__ takes three arguments): send its parts.
    try:
        return "ok", fn(_STATE["tokenizer"], job)
    except DataError as exc:
        return "data_error", (exc.file, exc.line, exc.detail)


def ordered_map(fn: Callable, jobs: Iterable, tokenizer, num_proc: int) -> Iterator:
    """fn(tokenizer, job) for each job, in order; in `num_proc` worker processes when it is above 1."""
    if num_proc <= 1:
        for job in jobs:
            yield fn(tokenizer, job)
        return
    # The workers are the parallelism: the Rust tokenizer's own threads would only contend with them,
    # and after a fork they would print a warning in every worker.
    with scoped_env("TOKENIZERS_PARALLELISM", "false"):
        yield from _pooled(fn, jobs, tokenizer, num_proc)


@contextmanager
def scoped_env(name: str, value: str) -> Iterator[None]:
    """`name` set to `value` for the block, and as it was after it, however the block ends (an error
    starting the pool, a consumer that stops early and closes the generator)."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def _pooled(fn: Callable, jobs: Iterable, tokenizer, num_proc: int) -> Iterator:
    # fork from the main thread only: a fork from another thread (ranks run as threads, an app's worker
    # thread) copies locks other threads hold mid-operation, and in the full test suite such workers
    # segfaulted as they started, re-forked by the Pool without end; spawn starts them clean
    fork = ("fork" in multiprocessing.get_all_start_methods() and sys.platform.startswith("linux")
            and threading.current_thread() is threading.main_thread())
    ctx = multiprocessing.get_context("fork" if fork else "spawn")
    if fork:
        _STATE["tokenizer"] = tokenizer
        # Everything this process holds (the tokenizer, every imported module) moves out of the garbage
        # collector's sight before the fork: a worker's collections would otherwise walk all of it, and touching
        # each object's header copies the pages it shares with this process.
        gc.freeze()
    try:
        pool = ctx.Pool(num_proc) if fork else ctx.Pool(num_proc, initializer=_init,
                                                         initargs=(pickle.dumps(tokenizer),))
        try:
            pending: deque = deque()
            for job in jobs:
                pending.append(pool.apply_async(_run, (fn, job)))
                if len(pending) >= IN_FLIGHT * num_proc:
                    yield _result(pending.popleft().get())
            while pending:
                yield _result(pending.popleft().get())
        finally:
            pool.terminate()
            pool.join()
    finally:
        if fork:
            gc.unfreeze()
        _STATE.pop("tokenizer", None)


def _result(outcome):
    kind, value = outcome
    if kind == "data_error":
        raise DataError(*value)
    return value
