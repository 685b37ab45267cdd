"""Data-parallel training on MLX's distributed runtime (mx.distributed; the ring backend over TCP, or
MPI / JACCL where mlx.launch sets them up).

Every rank holds the whole model, computes the gradient of its share of the
global batch, and the gradients are averaged with `mlx.nn.average_gradients`
(mlx-lm's trainer does the same), once per optimizer step. Like the torch
engines, the loss is divided by the loss units of the global batch and the
average multiplied back by the number of ranks, so N ranks at micro batch b
equal one process at micro batch N*b. The state is the same on every rank,
so checkpoints and outputs are written by rank 0 alone.

mx.distributed has no object broadcast; `_gather` sends pickled bytes
through all_gather, which is all the recipes need (a few small objects at
start and at each checkpoint).
"""

from __future__ import annotations

import pickle

import mlx.core as mx
import numpy as np

from ... import distributed as ranks_module

_group = None


def join() -> ranks_module.Ranks:
    """Join the group mlx.launch (or `mudpuppy run --nproc`) described in MLX_RANK / MLX_HOSTFILE."""
    global _group
    ranks = ranks_module.from_environment()
    if ranks.world == 1:
        return ranks_module.Ranks()
    if _group is None:
        _group = mx.distributed.init(strict=True)
    ranks.rank, ranks.world = _group.rank(), _group.size()
    ranks.barrier = barrier
    ranks.gather = gather
    ranks.broadcast = lambda obj: gather(obj if ranks.rank == 0 else None)[0]
    return ranks


def barrier() -> None:
    mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=_group))


def gather(obj) -> list:
    """Every rank's picklable object, on every rank."""
    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = np.array(mx.distributed.all_gather(mx.array([data.size], dtype=mx.int32), group=_group))
    buffer = np.zeros(int(sizes.max()), dtype=np.uint8)
    buffer[: data.size] = data
    everything = np.array(mx.distributed.all_gather(mx.array(buffer)[None], group=_group))
    return [pickle.loads(everything[i, : int(sizes[i])].tobytes()) for i in range(len(sizes))]


def all_sum(values: list[float]) -> list[float]:
    """Each value summed over the ranks (float32 on the wire: counts below 2**24 stay exact)."""
    out = mx.distributed.all_sum(mx.array(values, dtype=mx.float32), group=_group)
    return [float(v) for v in np.array(out)]


def average_gradients(grads):
    from mlx import nn

    return nn.average_gradients(grads, group=_group)
