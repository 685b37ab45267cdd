"""Continuous batching on MLX: the `Decoder` of backends/protocol.py, for `mudpuppy serve`.

A sequence is prefilled alone in the model's own cache, as streaming.py does, so its first
token is the single-prompt one. Once drawn, its cache joins the batch through mlx-lm's
`BatchKVCache` (`merge` left-pads it, `extend` appends it to the batch, `filter` drops rows
and the padding no row needs): per-row offsets keep each row's rotary positions its own and
the cache's mask keeps padding out, as generation.py relies on for left-padded sampling.
Each step feeds every row its last token in one forward pass; each row draws with a key of
its own, split from its seed exactly as streaming.py splits it, so a seeded answer is the
one `stream` gives and does not depend on the batch.

mlx-lm's `BatchGenerator` is not used, for generation.py's reason: its sampler is not the
protocol's. Models whose caches are not plain KV caches, or that lack rotary positions
(`generation.left_paddable` false), decode each sequence on its own in the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..decoding import BatchRows, NotFinite, SlotDecoder
from .generation import last_logits, left_paddable
from .sampling import filter_logits


@dataclass
class Sequence:
    sampling: object | None         # protocol Sampling; None: greedy
    key: mx.array | None
    logits: mx.array | None = None  # [1, V] to draw the next token from
    token: int | None = None        # drawn, not yet fed
    cache: list | None = None       # its own caches until it joins the batch


def open_decoder(handle):
    return BatchDecoder(handle) if left_paddable(handle) else SequenceDecoder(handle)


class SequenceDecoder(SlotDecoder):
    """Each sequence in caches of its own, one forward pass each per step: any model."""

    def __init__(self, handle):
        super().__init__(handle.model)
        self.handle = handle

    def prefill(self, prompt: list[int], sampling, seed: int) -> Sequence:
        from mlx_lm.models.cache import make_prompt_cache

        key = None
        if sampling is not None:
            _, key = mx.random.split(mx.random.key(seed % 2**64))   # streaming.sampled's first key
        cache = make_prompt_cache(self.handle.model)
        ids = mx.array([prompt])
        # greedy: generate's call (the whole forward); sampled: sample's (the head on the last position)
        if sampling is None:
            logits = self.handle.model(ids, cache=cache)[:, -1]
        else:
            logits = last_logits(self.handle, ids, cache)
        return Sequence(sampling, key, logits, cache=cache)

    def draw(self, seq: Sequence) -> int:
        if seq.sampling is None:
            check_finite(seq.logits)
            return int(mx.argmax(seq.logits[0]).item())
        seq.key, step_key = mx.random.split(seq.key)
        scores = filter_logits(seq.logits, seq.sampling)     # sampling.draw's two steps, checked between them
        check_finite(scores)
        return int(mx.random.categorical(scores, axis=-1, key=step_key).tolist()[0])

    def feed(self) -> None:
        for seq in self.seqs.values():
            if seq.token is not None:
                seq.logits = last_logits(self.handle, mx.array([[seq.token]]), seq.cache)


class BatchDecoder(BatchRows, SequenceDecoder):
    """Every joined sequence a row of one left-padded BatchKVCache; one forward pass per step."""

    def __init__(self, handle):
        super().__init__(handle)
        self.batch: list | None = None    # one BatchKVCache per layer

    def keep_rows(self, keep: list[int]) -> None:
        keep = mx.array(keep)
        for layer in self.batch:
            layer.filter(keep)

    def drop_batch(self) -> None:
        self.batch = None

    def feed(self) -> None:
        if not self.rows:
            return
        tokens = mx.array([[self.seqs[slot].token] for slot in self.rows])
        logits = last_logits(self.handle, tokens, self.batch)
        for row, slot in enumerate(self.rows):
            self.seqs[slot].logits = logits[row:row + 1]

    def join(self, slots: list[int]) -> None:
        from mlx_lm.models.cache import BatchKVCache

        if not slots:
            return
        layers = zip(*(self.seqs[slot].cache for slot in slots))
        joined = [BatchKVCache.merge(list(caches)) for caches in layers]
        if self.batch is None:
            self.batch = joined
        else:
            for layer, more in zip(self.batch, joined):
                layer.extend(more)
        for slot in slots:
            self.seqs[slot].cache = None
            self.rows.append(slot)


def check_finite(scores: mx.array) -> None:
    """NotFinite unless the best score is a finite number (mx.max is NaN when any score is)."""
    if not mx.isfinite(scores.max()).item():
        raise NotFinite()
