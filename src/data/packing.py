"""Sequence packing: which examples share a row. Pure bookkeeping over lengths.

Best-fit decreasing puts each example, longest first, into the open row it
fills most tightly. It is deterministic (ties go to the lower index) and
typically fills rows to within a few percent of the total, which is what
`packing_efficiency` reports. Isolation between the examples of a row is
the batch's business (`batch.collate_packed`) and the backend's (a
block-diagonal attention mask).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence


def pack_sequences(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of example indices; every index appears exactly once and no row exceeds `capacity`."""
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        raise ValueError(f"{len(too_long)} sequences are longer than the row length {capacity} "
                         f"(the first: #{too_long[0]}, {lengths[too_long[0]]} tokens); truncate them first")
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []     # (room left, row), sorted: the tightest fit is found by bisection
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        at = bisect_left(free, (n, -1))
        if at < len(free):
            room, row = free.pop(at)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        if room - n > 0:
            insort(free, (room - n, row))
    return rows


def packing_efficiency(lengths: Sequence[int], capacity: int) -> tuple[float, int]:
    """(share of row slots holding real tokens, number of rows) if these lengths were packed."""
    if not lengths:
        return 0.0, 0
    rows = pack_sequences(lengths, capacity)
    return sum(lengths) / (len(rows) * capacity), len(rows)
