"""Sequence packing: which examples share a row. Pure bookkeeping over lengths.

Best-fit decreasing puts each example, longest first, into the open row it
fills most tightly. It is deterministic (ties go to the lower index) and
typically fills rows to within a few percent of the total, which is what
`packing_efficiency` reports. Isolation between the examples of a row is
the batch's business (`batch.collate_packed`) and the backend's (a
block-diagonal attention mask, per layer type where the model has
sliding-window layers). `packing_problem` tells from a model's config.json,
before any weight loads, which models no mask can keep exact.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from heapq import heappop, heappush

import numpy as np

CHUNK = 1 << 16      # examples turned into Python ints at a time: the walk's memory stays flat


def pack_rows(lengths, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(flat, bounds): row r holds example indices flat[bounds[r]:bounds[r + 1]], in the order they
    were placed. Two arrays, so a million examples cost 16 bytes each, not a Python list apiece."""
    lengths = np.asarray(lengths, dtype=np.int64)
    too_long = np.flatnonzero(lengths > capacity)
    if len(too_long):
        first = int(too_long[0])
        raise ValueError(f"{len(too_long)} sequences are longer than the row length {capacity} "
                         f"(the first: #{first}, {lengths[first]} tokens); truncate them first")
    order = np.argsort(-lengths, kind="stable")      # longest first, ties by index
    row_of = _best_fit(lengths, order, capacity)
    # Within a row, examples keep the order they were placed in: the stable sort by row keeps it.
    flat = order[np.argsort(row_of[order], kind="stable")]
    del order
    counts = np.bincount(row_of, minlength=int(row_of.max()) + 1 if len(row_of) else 0)
    return flat, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _best_fit(lengths: np.ndarray, order: np.ndarray, capacity: int) -> np.ndarray:
    """The row of each example under best fit: the open row with the least room that still holds it,
    the lowest-numbered among equals. Open rows are kept per room left (a heap of row numbers each),
    with the sorted list of rooms that have any, so memory grows with the open rows, not the examples."""
    row_of = np.empty(len(lengths), dtype=np.int32 if len(lengths) < 2**31 else np.int64)
    rooms: list[int] = []                 # room values that have open rows, ascending
    by_room: dict[int, list[int]] = {}    # room left -> heap of row numbers
    rows = 0
    for at in range(0, len(order), CHUNK):
        idx = order[at:at + CHUNK]
        for i, n in zip(idx.tolist(), lengths[idx].tolist()):
            k = bisect_left(rooms, n)
            if k < len(rooms):
                room = rooms[k]
                heap = by_room[room]
                row = heappop(heap)
                if not heap:
                    del by_room[room]
                    rooms.pop(k)
            else:
                room, row = capacity, rows
                rows += 1
            row_of[i] = row
            left = room - n
            if left > 0:
                if left not in by_room:
                    by_room[left] = []
                    insort(rooms, left)
                heappush(by_room[left], row)
    return row_of


def pack_sequences(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of example indices; every index appears exactly once and no row exceeds `capacity`."""
    flat, bounds = pack_rows(lengths, capacity)
    return [flat[bounds[r]:bounds[r + 1]].tolist() for r in range(len(bounds) - 1)]


def packing_efficiency(lengths, capacity: int) -> tuple[float, int]:
    """(share of row slots holding real tokens, number of rows) if these lengths were packed."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if not len(lengths):
        return 0.0, 0
    rows = len(pack_rows(lengths, capacity)[1]) - 1
    return int(lengths.sum()) / (rows * capacity), rows


# Layer types a block-diagonal mask (windowed where the layer slides) keeps exact.
PACKABLE_LAYERS = ("full_attention", "sliding_attention")


def packing_problem(config: dict | None) -> str | None:
    """Why packed examples of the model a config.json describes cannot be kept apart exactly, or None.

    Attention masks isolate attention layers only: a recurrent (Mamba / SSM) or linear-attention layer
    carries its state across the examples of a row, and chunked attention (Llama 4) has no mask
    mudpuppy builds. The torch backend checks the decoder itself again when it builds the mask."""
    if not config:
        return None
    text = config.get("text_config") or config
    family = text.get("model_type") or config.get("model_type") or "this model"
    odd = sorted(set(text.get("layer_types") or ()) - set(PACKABLE_LAYERS))
    if odd:
        what = f"{', '.join(map(str, odd))} layers"
    elif text.get("attention_chunk_size"):
        what = "chunked attention (attention_chunk_size)"
    elif any(key.startswith(("mamba", "ssm_")) for key in text):
        what = "recurrent (Mamba) layers"
    else:
        return None
    return (f"{family} has {what}, which carry information across the examples of a packed row; "
            "set data.packing: false (data.tokens_per_batch keeps padding low)")
