"""`--nproc` on the torch backends: N copies of the run through torch.distributed.run, the engine behind
torchrun (standalone rendezvous on this node, no restarts). The launcher-neutral parts (the copies'
arguments and environment, naming the rank that failed) are in mudpuppy/launch.py, which calls this."""

from __future__ import annotations


def launch_torch(cfg, nproc: int, run_args: list[str], echo=print) -> dict:
    """Run the copies to the end; the launcher's failures by rank ({} when every copy finished)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
                       "--module", "mudpuppy", "run", *run_args])
    echo(f"launching {nproc} processes on this node (torch.distributed.run, strategy {cfg.distributed.strategy})")
    try:
        run(args)
    except ChildFailedError as exc:
        return exc.failures
    return {}
