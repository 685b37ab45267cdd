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
