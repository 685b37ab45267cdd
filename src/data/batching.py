"""Examples to micro-batches in a deterministic, resumable order.

Four ways to form batches, chosen by the config:

- plain: ``micro_batch_size`` examples per batch, padded to the longest;
- grouped (``group_by_length``): the same, but examples of similar length together;
- token budget (``tokens_per_batch``): length-grouped batches whose padded
  size (rows x longest) stays within the budget, so short examples come many
  to a batch and long ones few;
- packed (``packing``): examples packed into rows of ``sequence_len`` tokens,
  ``micro_batch_size`` rows per batch (or as many as the token budget holds).

Batches (or packed rows) are formed once from the seed; each epoch visits
them in an order drawn from ``seed + epoch`` alone. A batcher's position is
therefore two integers, and a resumed run sees exactly the batches an
uninterrupted one would. This is also mlx-lm's design: fixed batches,
shuffled order.

In a distributed run of N processes every rank walks the same global order,
N times as many units per step, and keeps its own contiguous share of each
global batch: rank r of N at micro batch b sees rows r*b..(r+1)*b-1 of the
batch one process at micro batch N*b would see. The position is global, so
a checkpoint resumes with any number of processes.
"""

from __future__ import annotations

import numpy as np

from ..errors import MudpuppyError
from .batch import IGNORE_INDEX, Batch, collate, collate_packed
from .examples import Example
from .packing import pack_rows

__all__ = ["IGNORE_INDEX", "Batch", "Batcher", "collate", "collate_packed", "fixed_batches",
           "group_by_length", "group_by_token_budget"]


class Batcher:
    """Yields micro-batches epoch after epoch; its position is plain state for exact resume."""

    def __init__(self, examples: list[Example], micro_batch_size: int, pad_id: int, seed: int,
                 shuffle: bool = True, *, packing: bool = False, sequence_len: int | None = None,
                 tokens_per_batch: int | None = None, group_by_length: bool = False, collate_fn=collate,
                 shard: tuple[int, int] = (0, 1)):
        if not examples:
            raise ValueError("no examples to batch")
        if packing and sequence_len is None:
            raise ValueError("packing needs sequence_len, the length of a packed row")
        self.examples = examples
        self.micro_batch_size = micro_batch_size
        self.pad_id = pad_id
        self.seed = seed
        self.shuffle = shuffle
        self.packing = packing
        # Preference, KTO and reward items batch through their own collate (see pairs.py).
        self.collate_fn = collate_fn
        self.lengths = lengths_of(examples)
        self.mode, self._units, self._per_batch = plan_batches(
            self.lengths, micro_batch_size, seed, packing=packing, sequence_len=sequence_len,
            tokens_per_batch=tokens_per_batch, by_length=group_by_length)
        # (rank, world): each step takes `world` times the units and this rank keeps its share.
        self.rank, self.world = shard
        self._per_batch *= self.world
        self.epoch = 0
        self.position = 0          # units (examples, rows or batches) consumed this epoch
        self._order = self._order_for(0)

    @classmethod
    def from_config(cls, examples: list[Example], cfg, pad_id: int, collate_fn=collate, ranks=None) -> Batcher:
        """The batcher a RunConfig describes (training.micro_batch_size/seed, data.packing/...), for this
        process's rank of a distributed run (`ranks`, the backend's distributed.Ranks; None: one process)."""
        d, t = cfg.data, cfg.training
        rank, world = (0, 1) if ranks is None else (ranks.rank, ranks.world)
        return cls(examples, t.micro_batch_size, pad_id, t.seed, d.shuffle, packing=d.packing,
                   sequence_len=d.sequence_len, tokens_per_batch=d.tokens_per_batch,
                   group_by_length=d.group_by_length, collate_fn=collate_fn, shard=(rank, world))

    @property
    def batches_per_epoch(self) -> int:
        return -(-len(self._units) // self._per_batch)

    def _order_for(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self._units))
        return np.random.default_rng(self.seed + epoch).permutation(len(self._units))

    def next_batch(self) -> Batch:
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._order_for(self.epoch)
        take = self._order[self.position : self.position + self._per_batch]
        self.position += len(take)
        mine, placeholder = self._share(take)
        units = [self._units[u] for u in mine]
        if self.packing:
            batch = collate_packed([[self.examples[i] for i in row] for row in units], self.pad_id)
        else:
            batch = self.collate_fn([self.examples[i] for unit in units for i in unit], self.pad_id)
        if placeholder:
            batch.placeholder = True
        return batch

    def _share(self, take: np.ndarray) -> tuple[np.ndarray, bool]:
        """This rank's contiguous part of a global batch. The last batch of an epoch may hold fewer
        units than ranks: a rank left without any gets a copy of the first, marked `placeholder`, which
        the trainer runs with weight zero (every rank must take part in each step's collectives)."""
        if self.world == 1:
            return take, False
        mine = np.array_split(take, self.world)[self.rank]
        return (mine, False) if len(mine) else (take[:1], True)

    def epoch_fill(self) -> tuple[int, int, int]:
        """(real tokens, batch slots, batches) of one epoch under this batching, from the lengths alone:
        what collating every batch would count, without building any (for reports). Exact, and walked
        a block of whole batches at a time so that its arrays do not grow with the dataset."""
        units, per = self._units, self._per_batch
        real = slots = 0
        step = max(1, FILL_BLOCK // per) * per
        for first in range(0, len(units), step):
            bounds = units.bounds_of(first, min(first + step, len(units)))
            lengths = self.lengths[units.flat[bounds[0]:bounds[-1]]]
            starts = bounds[:-1] - bounds[0]
            firsts = np.arange(0, len(starts), per)
            if self.packing:       # rows of a batch padded to its fullest row
                sums = np.add.reduceat(lengths, starts)
                slots += int((np.add.reduceat(np.ones(len(starts), np.int64), firsts)
                              * np.maximum.reduceat(sums, firsts)).sum())
            else:                  # examples of a batch padded to its longest
                widest = np.maximum.reduceat(lengths, starts)
                slots += int((np.add.reduceat(np.diff(bounds), firsts) * np.maximum.reduceat(widest, firsts)).sum())
            real += int(lengths.sum())
        return real, slots, self.batches_per_epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "mode": self.mode, "units": len(self._units)}

    def load_state_dict(self, state: dict) -> None:
        # A state from different data or settings would silently resume elsewhere.
        for key, mine in (("seed", self.seed), ("mode", self.mode), ("units", len(self._units))):
            if key in state and state[key] != mine:
                raise MudpuppyError(
                    f"cannot resume: the saved batch order does not match this data (saved {key}={state[key]!r}, "
                    f"now {mine!r}); the data, the seed or the batching settings changed since the checkpoint. "
                    "Resume with the same data section, or start a fresh run")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._order_for(self.epoch)


FILL_BLOCK = 1 << 16     # units per block of epoch_fill's walk


class Units:
    """Batching units (an example, a packed row or a whole batch) as lists of example indices, held
    flat: unit u is flat[bounds[u]:bounds[u + 1]]. Two arrays, not a million Python lists; units of one
    size (plain and length-grouped batching) keep no bounds at all, only the size."""

    def __init__(self, flat: np.ndarray, bounds: np.ndarray | None, size: int = 0):
        self.flat, self.bounds, self.size = flat, bounds, size

    @classmethod
    def from_lists(cls, lists: list[list[int]]) -> Units:
        flat = np.fromiter((i for unit in lists for i in unit), dtype=np.int64)
        return cls(flat, np.concatenate([[0], np.cumsum([len(u) for u in lists], dtype=np.int64)]))

    @classmethod
    def consecutive(cls, order: np.ndarray, size: int) -> Units:
        """`order` cut into units of `size` (the last may be shorter)."""
        return cls(order, None, size)

    def __len__(self) -> int:
        return -(-len(self.flat) // self.size) if self.bounds is None else len(self.bounds) - 1

    def bounds_of(self, first: int, end: int) -> np.ndarray:
        """bounds[first:end + 1]: where units first..end-1 start, and where the last one ends."""
        if self.bounds is not None:
            return self.bounds[first:end + 1]
        return np.minimum(np.arange(first, end + 1, dtype=np.int64) * self.size, len(self.flat))

    def __getitem__(self, u) -> np.ndarray:
        if self.bounds is None:
            return self.flat[u * self.size:(u + 1) * self.size]
        return self.flat[self.bounds[u]:self.bounds[u + 1]]


def lengths_of(examples) -> np.ndarray:
    """Every example's length: a store view has them as one array; a list is asked one by one."""
    known = getattr(examples, "lengths", None)
    if known is not None:
        return np.asarray(known, dtype=np.int64)
    return np.fromiter((len(e) for e in examples), dtype=np.int64, count=len(examples))


def plan_batches(lengths, micro_batch_size: int, seed: int, *, packing: bool = False,
                 sequence_len: int | None = None, tokens_per_batch: int | None = None,
                 by_length: bool = False) -> tuple[str, Units, int]:
    """(mode, units, units per batch): a unit is an example, a packed row, or a whole batch."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if packing:
        per_batch = max(1, tokens_per_batch // sequence_len) if tokens_per_batch else micro_batch_size
        return "packed", Units(*pack_rows(lengths, sequence_len)), per_batch
    if tokens_per_batch:
        return "token_budget", Units(*token_budget_batches(lengths, tokens_per_batch, seed)), 1
    if by_length:
        return "by_length", Units.consecutive(_length_order(lengths, seed), micro_batch_size), 1
    return "plain", Units.consecutive(np.arange(len(lengths), dtype=np.int64), 1), micro_batch_size


def _length_order(lengths: list[int], seed: int) -> np.ndarray:
    """Indices by length; equal lengths in an order drawn from the seed, so that ties do not
    always put the same examples together."""
    tiebreak = np.random.default_rng(seed).permutation(len(lengths))
    return np.lexsort((tiebreak, np.asarray(lengths)))


def group_by_length(lengths: list[int], batch_size: int, seed: int) -> list[list[int]]:
    order = _length_order(lengths, seed).tolist()
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def group_by_token_budget(lengths: list[int], budget: int, seed: int) -> list[list[int]]:
    """Batches of similar length whose padded size (count x longest) is at most `budget`."""
    flat, bounds = token_budget_batches(lengths, budget, seed)
    return [flat[bounds[b]:bounds[b + 1]].tolist() for b in range(len(bounds) - 1)]


def token_budget_batches(lengths, budget: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(flat, bounds) of group_by_token_budget's batches, as two arrays."""
    lengths = np.asarray(lengths, dtype=np.int64)
    too_long = lengths[lengths > budget]
    if len(too_long):
        raise ValueError(f"{len(too_long)} examples are longer than tokens_per_batch={budget} "
                         f"(longest {too_long.max()}); raise the budget or lower sequence_len")
    order = _length_order(lengths, seed)
    ordered = lengths[order]
    starts = []
    start = 0
    while start < len(order):
        # Ascending order: the newest example is the longest, so it sets the padded width; a batch
        # starting here holds at most budget // its shortest examples, so only those are looked at.
        window = ordered[start:start + budget // int(ordered[start]) + 1]
        over = np.flatnonzero(np.arange(1, len(window) + 1) * window > budget)
        starts.append(start)
        start += int(over[0]) if len(over) else len(window)
    return order, np.array(starts + [len(order)], dtype=np.int64)


def fixed_batches(examples: list[Example], batch_size: int, pad_id: int) -> list[Batch]:
    """Evaluation batches in file order: simple and reproducible."""
    return [collate(examples[i : i + batch_size], pad_id) for i in range(0, len(examples), batch_size)]
