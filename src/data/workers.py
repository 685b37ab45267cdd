"""Worker processes that tokenize chunks of records, results in submission order.

The tokenizer reaches the workers once, not with every chunk: where `fork`
exists (Linux) the workers inherit it from the parent's memory; elsewhere
(macOS, Windows: `spawn`) it is pickled once into each worker. Each worker
has a pipe of its own and works on one chunk at a time; the main thread hands
the next chunk (read ahead) to whichever worker is free, and results come
back in the order the chunks went out, at most two per worker ahead of the
oldest, so a reader faster than the tokenizer never piles records up in
memory and the output is the same for any number of workers.

The main thread waits on the pipes and on the workers' own process handles
together, with no helper threads: a worker that dies (the OOM killer's
SIGKILL, a segfault) ends the wait at once with `WorkerDied`, naming how it
died and the chunk it was on. (multiprocessing.Pool started a new worker and
waited for the lost chunk forever.)
"""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from ..errors import DataError, MudpuppyError

IN_FLIGHT = 2          # results per worker that may wait for an older chunk's
_STATE: dict = {}      # the tokenizer the forked workers inherit
_END = object()


class WorkerDied(MudpuppyError):
    """A worker process ended without sending its chunk back: killed (the OOM killer's SIGKILL, a segfault)
    or exited. Whatever it was writing is incomplete, so the run stops."""


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container or taskset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                      # macOS and Windows have no affinity mask
        return os.cpu_count() or 1


def chunk_place(name: str, chunk) -> str:
    """Where a chunk came from, for messages: 'data.jsonl, lines 513-1024' (raw lines or records), or rows."""
    if hasattr(chunk, "lines"):                 # stream.RawLines: (line number, body) pairs
        at, unit = [n for n, _ in chunk.lines[:1] + chunk.lines[-1:]], "lines"
    else:
        at = [r.line if r.line is not None else r.row for r in chunk[:1] + chunk[-1:]]
        unit = "lines" if chunk and chunk[0].line is not None else "rows"
    return f"{name}, {unit} {at[0]}-{at[-1]}" if at else name


def ordered_map(fn: Callable, jobs: Iterable, tokenizer, num_proc: int, where: Callable | None = None,
                role: str = "tokenizing") -> Iterator:
    """fn(tokenizer, job) for each job, in order; in `num_proc` worker processes when it is above 1.
    `where(job)` names a job's data in the message of a worker that dies on it; `role` names the workers."""
    if num_proc <= 1:
        for job in jobs:
            yield fn(tokenizer, job)
        return
    # The workers are the parallelism: the Rust tokenizer's own threads would only contend with them,
    # and after a fork they would print a warning in every worker.
    with scoped_env("TOKENIZERS_PARALLELISM", "false"):
        yield from _pooled(fn, jobs, tokenizer, num_proc, where, role)


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


def _pooled(fn: Callable, jobs: Iterable, tokenizer, num_proc: int, where, role: str) -> Iterator:
    # fork from the main thread only: a fork from another thread (ranks run as threads, an app's worker
    # thread) copies locks other threads hold mid-operation, and in the full test suite such workers
    # segfaulted as they started (multiprocessing.Pool re-forked them without end); spawn starts them clean
    fork = ("fork" in multiprocessing.get_all_start_methods() and sys.platform.startswith("linux")
            and threading.current_thread() is threading.main_thread())
    ctx = multiprocessing.get_context("fork" if fork else "spawn")
    if fork:
        _STATE["tokenizer"] = tokenizer
        # Everything this process holds (the tokenizer, every imported module) moves out of the garbage
        # collector's sight before the fork: a worker's collections would otherwise walk all of it, and touching
        # each object's header copies the pages it shares with this process.
        gc.freeze()
    pool = _Workers(where, role)
    try:
        pool.start(ctx, num_proc, fn, None if fork else pickle.dumps(tokenizer))
        yield from _in_order(pool, iter(jobs))
        pool.stop()
    finally:
        pool.close()
        if fork:
            gc.unfreeze()
        _STATE.pop("tokenizer", None)


def _in_order(pool: _Workers, jobs: Iterator) -> Iterator:
    """Hand the jobs to free workers (one read ahead, so none waits for the reader), results in job order."""
    done: dict[int, tuple] = {}
    ahead = deque(j for j in [next(jobs, _END)] if j is not _END)
    sent = emitted = 0
    while True:
        for w in pool.free():
            if not ahead or sent - emitted >= IN_FLIGHT * len(pool.procs):
                break
            pool.send(w, sent, ahead.popleft())
            sent += 1
            if (job := next(jobs, _END)) is not _END:
                ahead.append(job)
        while emitted in done:
            yield _result(done.pop(emitted))
            emitted += 1
        if emitted == sent:             # nothing out: hand out more, or stop
            if not ahead:
                return
            continue
        done.update(pool.wait())        # the oldest job is still with a worker


class _Workers:
    """Worker processes, a pipe each, and the job each is on (its number and the job itself)."""

    def __init__(self, where, role: str):
        self.where, self.role = where, role
        self.procs, self.conns, self.busy = [], [], []

    def start(self, ctx, num_proc: int, fn: Callable, blob: bytes | None) -> None:
        for _ in range(num_proc):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(theirs, fn, blob), daemon=True)
            proc.start()
            theirs.close()          # the worker's end lives in the worker alone: its death is an EOF here
            self.procs.append(proc)
            self.conns.append(mine)
            self.busy.append(None)

    def free(self) -> list[int]:
        return [w for w, job in enumerate(self.busy) if job is None]

    def send(self, w: int, number: int, job) -> None:
        self.busy[w] = (number, job)
        try:
            self.conns[w].send((number, job))
        except OSError:             # a broken pipe: the worker is gone
            raise self.died(w) from None

    def wait(self) -> list[tuple[int, tuple]]:
        """(job number, outcome) of each result ready, waiting for one; WorkerDied as soon as a worker is gone."""
        ready = set(multiprocessing.connection.wait(self.conns + [p.sentinel for p in self.procs]))
        results = []
        for w, conn in enumerate(self.conns):
            if conn in ready:
                try:
                    results.append(conn.recv())
                except (EOFError, OSError):     # nothing, or part of a result: it died sending
                    raise self.died(w) from None
                self.busy[w] = None
        for w, proc in enumerate(self.procs):
            if proc.sentinel in ready:
                raise self.died(w)
        return results

    def died(self, w: int) -> WorkerDied:
        proc = self.procs[w]
        proc.join(5)
        code = proc.exitcode
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit code {code}" if code is not None else "exit code unknown"
        job = self.busy[w]
        place = self.where(job[1]) if job is not None and self.where is not None else None
        on = f" on {place}" if place else (f" on job {job[0]}" if job is not None else " between jobs")
        return WorkerDied(f"a {self.role} worker process died ({how}){on} and sent nothing back, so the "
                          "data cannot be complete. Running out of memory is the usual cause (the kernel's OOM "
                          "killer sends SIGKILL; `dmesg` names it): set data.num_proc: 1 to tokenize in this "
                          "process alone, or give the run more memory")

    def stop(self) -> None:
        """Every job done: each worker told to finish."""
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(5)

    def close(self) -> None:
        """However the map ended (an error, a consumer that stopped early): no worker outlives it."""
        for proc in self.procs:
            if proc.exitcode is None:
                proc.terminate()
        for proc in self.procs:
            proc.join()
        for conn in self.conns:
            conn.close()


def _serve(conn, fn: Callable, blob: bytes | None) -> None:
    """A worker: jobs in, outcomes out, until told to stop (None) or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the parent's to handle: it ends the workers
    tokenizer = _STATE["tokenizer"] if blob is None else pickle.loads(blob)
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        number, job = task
        conn.send((number, _run(fn, tokenizer, job)))


def _run(fn: Callable, tokenizer, job) -> tuple:
    # A DataError does not survive pickling (its __init__ takes three arguments): send its parts.
    try:
        return "ok", fn(tokenizer, job)
    except DataError as exc:
        return "data_error", (exc.file, exc.line, exc.detail)
    except Exception as exc:        # a bug: raised in the parent, with the worker's traceback as a note
        text = traceback.format_exc()
        try:
            pickle.dumps(exc)
        except Exception:
            exc = RuntimeError(repr(exc))
        return "error", (exc, text)


def _result(outcome):
    kind, value = outcome
    if kind == "data_error":
        raise DataError(*value)
    if kind == "error":
        exc, text = value
        if hasattr(exc, "add_note"):
            exc.add_note(f"in a worker process:\n{text}")
        raise exc
    return value
