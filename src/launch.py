"""`mudpuppy run --nproc N`: start N copies of the run on this node through the launcher each runtime ships.

torch: torch.distributed.run, the engine behind `torchrun` (standalone
rendezvous on this node, no restarts). MLX: the processes mlx.launch would
start for its ring backend (MLX_RANK, MLX_HOSTFILE). Each copy runs
`python -m mudpuppy run` with the same arguments minus --nproc; the copies
find their rank in the launcher's environment (distributed.py).

When a copy fails, the launcher stops the others; this process then prints
one message naming the rank and its cause, where the newest complete
checkpoint is, and exits non-zero. The copies themselves print nothing for
a failure (they write it to the launcher's error file instead), so the
message appears once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .errors import MudpuppyError

# Set for the copies this launcher starts: they leave the failure message to it.
LAUNCHED_ENV = "MUDPUPPY_LAUNCHER"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


class RankFailed(MudpuppyError):
    pass


def child_arguments(argv: list[str]) -> list[str]:
    """The `mudpuppy run` arguments each copy gets: these, without --nproc and its value."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        out.append(arg)
    return out


def threads_per_process(nproc: int) -> int:
    return max(1, (os.cpu_count() or 1) // nproc)


def launch(cfg, backend_name: str, nproc: int, run_args: list[str], echo=print) -> int:
    """Start `nproc` copies of `mudpuppy run run_args`; returns the exit code of the whole run."""
    if backend_name == "mlx":
        return launch_mlx(cfg, nproc, run_args, echo)
    from .backends.torch.launch import launch_torch

    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(nproc)))
    os.environ[LAUNCHED_ENV] = "1"                  # the copies inherit it: they leave the message to this one
    failures = launch_torch(cfg, nproc, run_args, echo)
    if failures:
        raise_failure(cfg, *first_cause(failures))
    return 0


# How a process that lost its peers reports it: it is a consequence of another rank's failure, never the cause.
PEER_LOST = "lost contact with another process"


def first_cause(failures: dict) -> tuple[int, str, int]:
    """The rank whose failure stopped the run and why. A rank that reported an error (a mudpuppy error
    or a crash) comes first; then one killed by a signal other than the launcher's own SIGTERM; ranks
    that only lost contact with the failed one come last."""
    def wrote(f) -> str:
        message = (getattr(f, "error_file_data", None) or {}).get("message", "<NONE>")
        if isinstance(message, dict):           # the launcher's error-file layout: {"message": {"message": ...}}
            message = message.get("message", "")
        return "" if message == "<NONE>" else str(message)

    def order(item):
        rank, f = item
        message = wrote(f)
        if message and not message.startswith(PEER_LOST):
            tier = 0                                    # said what went wrong
        elif message:
            tier = 2                                    # lost contact with the one that failed
        elif f.exitcode < 0 and f.signal_name() == "SIGTERM":
            tier = 3                                    # stopped by the launcher
        else:
            tier = 1                                    # killed, or died without a word
        # Of ranks that said the same, the one that exited by itself (the others were stopped mid-exit).
        return tier, f.exitcode <= 0, rank

    rank, failure = min(failures.items(), key=order)
    if wrote(failure):
        cause = wrote(failure)
    elif failure.exitcode < 0:
        cause = f"killed by {failure.signal_name()}"
    else:
        cause = f"exit code {failure.exitcode}"
    code = failure.exitcode if failure.exitcode > 0 else 1
    return rank, cause, code


def is_peer_loss(exc: BaseException) -> bool:
    """A collective that failed because another process went away (gloo, nccl, MLX ring)."""
    text = str(exc).lower()
    return type(exc).__name__ in ("DistNetworkError", "DistBackendError") or any(
        phrase in text for phrase in ("connection reset by peer", "connection closed by peer",
                                      "connection to a peer was lost", "broken pipe"))


def raise_failure(cfg, rank: int, cause: str, code: int) -> None:
    from .training.checkpoints import newest_complete

    newest = newest_complete(Path(cfg.output_dir))
    kept = (f"the newest complete checkpoint, {newest}, is kept: continue with --resume" if newest
            else "no checkpoint had been written")
    error = RankFailed(f"rank {rank} failed: {cause}; every process was stopped; {kept}")
    error.exit_code = code
    raise error


def launch_mlx(cfg, nproc: int, run_args: list[str], echo=print) -> int:
    """N local processes joined by MLX's ring backend: each gets MLX_RANK and the host list mlx.launch would
    write (MLX_HOSTFILE). Started directly rather than through mlx.launch, which exits 0 whatever its
    processes did and keeps a core busy relaying their output; this launcher, like torchrun's, stops
    the others as soon as one fails."""
    import socket

    ports = []
    for _ in range(nproc):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    work = Path(tempfile.mkdtemp(prefix="mudpuppy-ranks-"))
    hostfile = work / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))
    base = {**os.environ, LAUNCHED_ENV: "1", "MUDPUPPY_ERROR_DIR": str(work), "MLX_HOSTFILE": str(hostfile),
            "MLX_WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
    echo(f"launching {nproc} processes on this node (mx.distributed, ring backend)")
    procs = [subprocess.Popen([sys.executable, "-m", "mudpuppy", "run", *run_args],
                              env={**base, "MLX_RANK": str(rank), "LOCAL_RANK": str(rank)})
             for rank in range(nproc)]
    try:
        failed = _wait_all(procs)
        if failed is not None:
            rank, code = _root_failure(work, procs, failed)
            cause = _mlx_cause(work, rank, code)
            raise_failure(cfg, rank, cause, code if code > 0 else 1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _wait_all(procs, grace_s: float = 10.0) -> tuple[int, int] | None:
    """Wait for every process; on the first failure stop the rest. (rank, exit code) of that failure."""
    while True:
        codes = [p.poll() for p in procs]
        bad = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if bad:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            deadline = time.monotonic() + grace_s
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
            return bad[0]
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.2)


def _root_failure(work: Path, procs, first: tuple[int, int]) -> tuple[int, int]:
    """Of the failed processes, the one whose failure is not just having lost contact with another."""
    for rank, proc in enumerate(procs):
        code = proc.returncode
        if code in (None, 0) or code == -15:
            continue
        written = work / f"rank-{rank:04d}.json"
        if not written.is_file() or not json.loads(written.read_text())["message"].startswith(PEER_LOST):
            return rank, code
    return first


def _mlx_cause(work: Path, rank: int, code: int) -> str:
    written = work / f"rank-{rank:04d}.json"
    message = json.loads(written.read_text())["message"] if written.is_file() else ""
    if message and not message.startswith(PEER_LOST):
        return message
    if code < 0:
        import signal

        return f"killed by {signal.Signals(-code).name}"
    return message or f"exit code {code}"


def record_failure(message: str) -> bool:
    """In a copy: write the failure where the launcher reads it; True when the launcher will print it."""
    from .distributed import from_environment

    rank = from_environment().rank
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
        Path(path).write_text(json.dumps(data), encoding="utf-8")
    mlx_dir = os.environ.get("MUDPUPPY_ERROR_DIR")
    if mlx_dir:
        Path(mlx_dir).mkdir(parents=True, exist_ok=True)
        (Path(mlx_dir) / f"rank-{rank:04d}.json").write_text(json.dumps({"rank": rank, "message": message}))
    return os.environ.get(LAUNCHED_ENV) == "1"
