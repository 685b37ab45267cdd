"""Attention while decoding on a CPU: a grouped-query model's one-token query packed per key/value head.

transformers' own SDPA path is kept for training and for every other device; decoding (sampling.py,
streaming.py, batch_decode.py) holds `packed_kv_heads_at_decode` around its forward passes.
"""

from __future__ import annotations

import contextlib
import threading

import torch


@contextlib.contextmanager
def packed_kv_heads_at_decode(device: torch.device):
    """While decoding on a CPU, a one-token query of a grouped-query model (fewer key/value heads than
    query heads) attends through transformers' own packing of each key/value head's queries into one
    [rows, kv heads, group, dim] query, not through SDPA's `enable_gqa`.

    transformers takes `enable_gqa` whenever there is no attention mask (prompts of one length), and
    torch's CPU kernel for it is slow at one query in bf16: SmolLM2-135M's decode attention, [16, 9, 1, 64]
    against 3 key/value heads of ~70 positions, took 1.13 ms a call with `enable_gqa` and 0.22 ms packed
    (one thread, AMD EPYC, bf16), 0.93 s of a 5.3 s GRPO sampling call. With a mask transformers packs
    already; an all-true mask at one query changes nothing but that choice, so it is what is passed. The
    values are the same attention to rounding (tests/training/test_grpo.py).

    transformers' attention table is process-wide; this changes it only through its public mapping
    interface, and only while a decode holds the context: the wrapper is installed for the first holder
    and the table restored after the last (a server thread and a training loop may overlap), and it packs
    only in a thread that holds the context, on CPU tensors. Other threads see transformers' own SDPA."""
    if device.type != "cpu":
        yield
        return
    _PACKED.enter()
    try:
        yield
    finally:
        _PACKED.exit()


class _PackedDecode:
    """The installed wrapper of transformers' "sdpa" attention function: counted by its holders across
    threads (installed once, restored by the last to leave) and by depth within each thread (whether
    the wrapper packs there)."""

    def __init__(self):
        self.lock, self.holders, self.previous = threading.Lock(), 0, None
        self.here = threading.local()

    def active(self) -> bool:
        """Whether the calling thread holds the context."""
        return getattr(self.here, "depth", 0) > 0

    def enter(self) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as table   # what the models look up

        with self.lock:
            if self.holders == 0:
                self.previous = table["sdpa"]
                table["sdpa"] = packed_at_one_query(self.previous, self.active)
            self.holders += 1
        self.here.depth = getattr(self.here, "depth", 0) + 1

    def exit(self) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as table

        self.here.depth -= 1
        with self.lock:
            self.holders -= 1
            if self.holders == 0:
                restore(table, "sdpa", self.previous)
                self.previous = None


def restore(table, key: str, previous) -> None:
    """Give `table[key]` back its `previous` function through the mapping interface alone: drop the
    override set on entry, and set `previous` again only if something else had overridden it before."""
    del table[key]
    if table[key] is not previous:
        table[key] = previous


_PACKED = _PackedDecode()


def packed_at_one_query(original, active):
    """transformers' `original` SDPA function, given an all-true mask at a one-token CPU query of a
    grouped-query model while `active()` (the calling thread decodes)."""
    def sdpa(module, query, key, value, attention_mask=None, *args, **kwargs):
        if (attention_mask is None and query.shape[2] == 1 and query.device.type == "cpu" and active()
                and getattr(module, "num_key_value_groups", 1) > 1 and kwargs.get("position_bias") is None):
            attention_mask = torch.ones((1, 1, 1, key.shape[2]), dtype=torch.bool, device=query.device)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    return sdpa
