"""`--nproc` on the torch backends: N copies of the run through torch.distributed.run, the engine behind
torchrun (standalone rendezvous on this node, no restarts). The launcher-neutral parts (the copies'
arguments, naming the rank that failed) are in mudpuppy/launch.py."""

from __future__ import annotations

import os

from ...launch import LAUNCHED_ENV, first_cause, raise_failure, threads_per_process


def launch_torch(cfg, nproc: int, run_args: list[str], echo=print) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(nproc)))
    os.environ[LAUNCHED_ENV] = "1"
    args = parse_args(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
                       "--module", "mudpuppy", "run", *run_args])
    echo(f"launching {nproc} processes on this node (torch.distributed.run, strategy {cfg.distributed.strategy})")
    try:
        run(args)
    except ChildFailedError as exc:
        rank, cause, code = first_cause(exc.failures)
        raise_failure(cfg, rank, cause, code)
    return 0
