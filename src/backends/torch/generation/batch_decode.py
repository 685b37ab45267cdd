"""Continuous batching on torch: the `Decoder` of backends/protocol.py, for `mudpuppy serve`.

Not transformers' own continuous batching (generation/continuous_batching): it swaps the
model's attention for a paged one, built for GPUs, and draws every request from one seed,
where a server needs each request's seed to give the same answer whatever shares the batch.

How a sequence goes through:

- `add` prefills the prompt alone, in a cache of its own, exactly as `generate` does for a
  single prompt (all-ones mask, the head on the last position only), so the first token is
  the one the single-prompt path gives.
- After its first token is drawn, its cache joins the batch: every layer's keys and values
  are left-padded to a common length and concatenated along the batch axis, with a 2-D
  attention mask marking the padding and explicit position ids (each row counts its own
  tokens), which is how `generate` runs a left-padded batch.
- Each `step` feeds every row its last token in one forward pass, then draws each row's next
  token from its own logits: argmax, or transformers' warpers (in `generate`'s order) and a
  multinomial draw from a `torch.Generator` of its own, seeded as `sample` seeds the global
  one, so a seeded answer is `sample`'s answer and does not depend on its neighbours.
- `remove` drops the row (index_select) and the columns that have become padding for all.

Models whose cache is not plain per-layer keys and values (sliding windows, recurrent state)
or that take no position ids decode each sequence on its own (`SequenceDecoder`): the same
interface and answers, without the batching.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ...decoding import BatchRows, NotFinite, SlotDecoder
from .decode_attention import packed_kv_heads_at_decode
from ..handle import unwrap


@dataclass
class Sequence:
    warpers: object | None          # transformers LogitsProcessorList; None: greedy
    generator: torch.Generator | None
    length: int                     # tokens in its cache (prompt and fed tokens)
    logits: torch.Tensor | None = None   # [V] float32 to draw the next token from
    token: int | None = None        # drawn, not yet fed
    cache: object = None            # its own cache until it joins the batch


def open_decoder(backend, handle):
    base = unwrap(handle.model)
    params = inspect.signature(base.forward).parameters
    if "position_ids" in params and plain_cache(base) is not None:
        return BatchDecoder(backend, handle)
    return SequenceDecoder(backend, handle)


def plain_cache(base):
    """A fresh DynamicCache when every layer is a plain growing one (what the batch merges), else None."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:
        return None
    if getattr(base.config, "is_encoder_decoder", False):
        return None
    try:
        cache = DynamicCache(config=base.config)
    except Exception:   # a config transformers cannot lay a cache out for: the model's own cache, alone
        return None
    return cache if all(type(layer) is DynamicLayer for layer in cache.layers) else None


class SequenceDecoder(SlotDecoder):
    """Each sequence in a cache of its own, one forward pass each per step: any causal LM."""

    def __init__(self, backend, handle):
        super().__init__(handle.model)
        self.backend, self.handle = backend, handle
        self.device = backend.plan.device
        base = unwrap(self.model)
        params = inspect.signature(base.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_last = "logits_to_keep" in params
        self.takes_positions = "position_ids" in params

    @torch.no_grad()
    def prefill(self, prompt: list[int], sampling, seed: int) -> Sequence:
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        logits, cache = self.forward(ids, torch.ones_like(ids), None, self.new_cache())
        return Sequence(*self.sampler(sampling, seed), length=len(prompt), logits=logits[0], cache=cache)

    @torch.no_grad()
    def step(self) -> dict[int, int]:
        return super().step()

    # ----------------------------------------------------------------- the parts
    def new_cache(self):
        return None     # the model builds its own

    def feed(self) -> None:
        for seq in self.seqs.values():
            if seq.token is None:
                continue
            ids = torch.tensor([[seq.token]], dtype=torch.long, device=self.device)
            mask = torch.ones((1, seq.length + 1), dtype=torch.long, device=self.device)
            positions = torch.tensor([[seq.length]], dtype=torch.long, device=self.device)
            logits, seq.cache = self.forward(ids, mask, positions, seq.cache)
            seq.logits, seq.length = logits[0], seq.length + 1

    def forward(self, ids, mask, positions, cache):
        """([B, V] float32 logits at the last position, the cache)."""
        kwargs = {"input_ids": ids, "attention_mask": mask, "use_cache": True, self.cache_kw: cache}
        if positions is not None and self.takes_positions:
            kwargs["position_ids"] = positions
        if self.keep_last:
            kwargs["logits_to_keep"] = 1
        with self.backend._autocast(self.handle), packed_kv_heads_at_decode(self.device):
            out = self.model(**kwargs)
        # generate copies the last position to fp32 before any processor sees it
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        for name in ("cache", "past_key_values"):
            if getattr(out, name, None) is not None:
                return logits, getattr(out, name)
        return logits, cache

    def sampler(self, sampling, seed: int):
        if sampling is None:
            return None, None
        from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                            TemperatureLogitsWarper, TopKLogitsWarper,
                                                            TopPLogitsWarper)

        # generate's warpers for do_sample, in its order (generation/utils.py, _get_logits_processor)
        warpers = LogitsProcessorList()
        if sampling.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k:
            warpers.append(TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
        if sampling.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))
        if sampling.min_p is not None:
            warpers.append(MinPLogitsWarper(min_p=sampling.min_p, min_tokens_to_keep=1))
        # sample() seeds the global generator with torch.manual_seed(seed); a Generator of the
        # same device seeded alike draws the same numbers (negative seeds wrap as torch wraps them)
        generator = torch.Generator(device=self.device).manual_seed(seed % 2**64)
        return warpers, generator

    def draw(self, seq: Sequence) -> int:
        logits = seq.logits[None]
        if seq.warpers is None:
            check_finite(logits)
            return int(torch.argmax(logits, dim=-1))
        scores = seq.warpers(torch.zeros((1, 0), dtype=torch.long, device=logits.device), logits)
        check_finite(scores)
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, num_samples=1, generator=seq.generator))


class BatchDecoder(BatchRows, SequenceDecoder):
    """Every joined sequence a row of one left-padded batch; one forward pass per step."""

    def __init__(self, backend, handle):
        super().__init__(backend, handle)
        self.base = unwrap(self.model)
        self.batch = None                      # the batch's DynamicCache
        self.mask: torch.Tensor | None = None  # [B, T] 1 for real tokens, 0 for padding

    def new_cache(self):
        return plain_cache(self.base)

    def keep_rows(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.mask = self.mask.index_select(0, index)
        for layer in self.batch.layers:
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        self.trim()

    def drop_batch(self) -> None:
        self.batch, self.mask = None, None

    # ----------------------------------------------------------------- the batch
    def feed(self) -> None:
        if not self.rows:
            return
        seqs = [self.seqs[slot] for slot in self.rows]
        ids = torch.tensor([[s.token] for s in seqs], dtype=torch.long, device=self.device)
        positions = torch.tensor([[s.length] for s in seqs], dtype=torch.long, device=self.device)
        mask = torch.cat([self.mask, torch.ones((len(seqs), 1), dtype=torch.long, device=self.device)], dim=1)
        logits, _ = self.forward(ids, mask, positions, self.batch)
        self.mask = mask
        for row, seq in enumerate(seqs):
            seq.logits, seq.length = logits[row], seq.length + 1

    @torch.no_grad()
    def join(self, slots: list[int]) -> None:
        """Sequences prefilled alone become rows of the batch, everything right-aligned."""
        if not slots:
            return
        caches = [self.seqs[s].cache for s in slots]
        width = max([self.mask.shape[1] if self.rows else 0] + [self.seqs[s].length for s in slots])
        masks, layers = [], []
        if self.rows:
            masks.append(pad_left(self.mask, width))
            layers.append([(pad_left(l.keys, width, -2), pad_left(l.values, width, -2)) for l in self.batch.layers])
        for slot, cache in zip(slots, caches):
            n = self.seqs[slot].length
            masks.append(pad_left(torch.ones((1, n), dtype=torch.long, device=self.device), width))
            layers.append([(pad_left(l.keys, width, -2), pad_left(l.values, width, -2)) for l in cache.layers])
        batch = self.batch if self.rows else caches[0]
        for i, layer in enumerate(batch.layers):
            layer.keys = torch.cat([parts[i][0] for parts in layers], dim=0)
            layer.values = torch.cat([parts[i][1] for parts in layers], dim=0)
        self.batch, self.mask = batch, torch.cat(masks, dim=0)
        for slot in slots:
            self.seqs[slot].cache = None
            self.rows.append(slot)

    def trim(self) -> None:
        """Drop the leading columns no remaining row uses."""
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else self.mask.shape[1]
        if start == 0:
            return
        self.mask = self.mask[:, start:]
        for layer in self.batch.layers:
            layer.keys, layer.values = layer.keys[..., start:, :], layer.values[..., start:, :]


def check_finite(scores: torch.Tensor) -> None:
    """NotFinite unless the best score is a finite number: max is NaN when any score is, +inf when one
    overflowed (a temperature near 0), -inf when every token was cut."""
    if not bool(torch.isfinite(scores.max())):
        raise NotFinite()


def pad_left(x: torch.Tensor, width: int, dim: int = -1) -> torch.Tensor:
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)
