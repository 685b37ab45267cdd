"""Which process of a distributed run this one is, for the parts of a run that are not the backend's.

A distributed run is N copies of the same `mudpuppy run` started by a
launcher (torchrun / `--nproc` on torch, mlx.launch on MLX). Each reads the
rank it was given from the launcher's environment; the backend that joins
the process group (backends/torch/distributed.py, backends/mlx/distributed.py)
returns a `Ranks` with its collectives (`backend.ranks`), the one copy of them: the run
hands it to whatever needs it. The recipes ask only
three things of it: am I the process that writes the run's outputs
(`is_main`), run this on the main process and tell everyone the answer
(`on_main`), and wait for everyone (`barrier`). A single-process run is
rank 0 of 1 and every call below is free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import MudpuppyError

# What launchers set: torchrun (torch.distributed.run) sets all three; mlx.launch sets MLX_RANK.
RANK_VARS = ("RANK", "MLX_RANK")
WORLD_VARS = ("WORLD_SIZE", "MLX_WORLD_SIZE")


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    # Installed by the backend that joined the process group; identity for one process.
    barrier: Callable[[], None] = field(default=lambda: None, repr=False)
    broadcast: Callable[[Any], Any] = field(default=lambda obj: obj, repr=False)     # rank 0's object to all
    gather: Callable[[Any], list] = field(default=lambda obj: [obj], repr=False)      # every rank's object, to all

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def on_main(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on rank 0 alone and return its result on every rank; a user error it raises is raised
        on every rank, so all processes stop with the same message instead of waiting on the one that left."""
        if not self.distributed:
            return fn()
        result, error, raised = None, None, None
        if self.is_main:
            try:
                result = fn()
            except MudpuppyError as exc:
                raised, error = exc, (str(exc), exc.exit_code)
        result, error = self.broadcast((result, error))
        if raised is not None:
            raise raised
        if error is not None:
            elsewhere = MudpuppyError(error[0])
            elsewhere.exit_code = error[1]
            raise elsewhere
        return result


def from_environment(environ=os.environ) -> Ranks:
    """This process's place as the launcher describes it (rank 0 of 1 when no launcher started it)."""
    def first(names, default):
        for name in names:
            if environ.get(name, "") != "":
                return int(environ[name])
        return default

    world = first(WORLD_VARS, 0) or _hostfile_size(environ.get("MLX_HOSTFILE")) or 1
    rank = first(RANK_VARS, 0)
    local_world = first(("LOCAL_WORLD_SIZE",), world)
    local_rank = first(("LOCAL_RANK",), rank if local_world == world else 0)
    return Ranks(rank, world, local_rank, local_world)


def _hostfile_size(path: str | None) -> int:
    """mlx.launch's ring backend names the world in a JSON host list, one entry per rank."""
    if not path:
        return 0
    import json

    try:
        return len(json.loads(open(path, encoding="utf-8").read()))
    except (OSError, ValueError):
        return 0


def launched() -> bool:
    """True when a launcher started this process as one of several."""
    return from_environment().world > 1


def check_same_config(cfg, ranks: Ranks) -> None:
    """Every rank must train the same run: a node started with another config would silently diverge."""
    import hashlib
    import json

    if not ranks.distributed:
        return
    dump = cfg.dump()
    dump.pop("resume", None)
    digest = hashlib.sha256(json.dumps(dump, sort_keys=True).encode()).hexdigest()[:12]
    digests = ranks.gather(digest)
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise MudpuppyError(f"ranks {', '.join(map(str, differ))} run a different config from rank 0 (config digests "
                            f"{', '.join(f'rank {r}: {d}' for r, d in enumerate(digests))}); start every node with "
                            "the same YAML file and --set overrides")


def is_placeholder(batch) -> bool:
    """A batch a rank runs with weight zero because its share of the global batch was empty (batching.py)."""
    return getattr(batch, "placeholder", False)


def whole(value: float) -> float | int:
    """A count summed over ranks as a float, back to an int when it is one."""
    return int(value) if float(value).is_integer() else value


def sum_step(ranks: Ranks, all_sum, total: float, tokens: int, sums: dict, weights: dict):
    """A step's loss total, real tokens and weighted metric sums, summed over the ranks with `all_sum`
    (the backend's all-reduce of a list of floats). The metric names are the union of the ranks':
    a rank may have seen none of a metric this step."""
    keys = sorted(set().union(*ranks.gather(sorted(sums))))
    reduced = all_sum([total, tokens] + [sums.get(k, 0.0) for k in keys] + [weights.get(k, 0) for k in keys])
    sums = dict(zip(keys, reduced[2 : 2 + len(keys)]))
    return reduced[0], int(reduced[1]), sums, dict(zip(keys, reduced[2 + len(keys):]))
