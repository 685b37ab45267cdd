"""Batched sampling with a KV cache: the completions GRPO scores.

Our own loop, not mlx-lm's BatchGenerator. That one batches continuously:
rows join as their prompts are prefilled (in batches of its own size) and
leave as they end, and it hands its sampler whichever rows are in flight,
so a keyed draw would depend on the neighbours' timing rather than on the
seed alone. What we do take from mlx-lm is its left-padding cache,
`BatchKVCache`: per-row offsets start each row's rotary positions at 0 on
its first real token, and its mask keeps the padding keys out, so a
left-padded row computes what the prompt alone computes.

Prompts of different lengths go into one left-padded batch when the model
honours the cache's mask, has rotary positions (handle.packable) and keeps
plain KV caches. Any other model (sliding-window or recurrent caches,
learned positions) samples prompts of equal length together, which needs no
padding; GRPO repeats each prompt num_generations times, so those groups
are natural.

Every row steps until all rows have stopped: a finished row goes on being
fed its draws, which are thrown away. A decode step reads the weights once
for the whole batch, so dropping finished rows would save little.

The draw for step s of a batch uses a key split off mx.random.key(seed),
one batch and one step at a time: the ids depend on the seed, the prompts
and the weights, and MLX's global random state is neither read nor moved.
With a seed per row (a list), the rows sharing a seed draw together from
that seed's own chain of keys, split the same way, so their ids do not
depend on the rest of the batch (GRPO gives each prompt's group its own
seed: a group samples the same completions on any rank of a distributed
run); rows sharing one seed draw what they would draw with it as an int.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ...errors import MudpuppyError
from ..protocol import Sampling
from .forward import hidden_and_head
from .sampling import draw

PAD_ID = 0   # any id: the cache's mask keeps left padding out of every real token's attention


def sample(handle, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int], sampling: Sampling,
           seed: int | list[int]) -> list[list[int]]:
    """Sampled continuation ids per prompt; a row's first stop token ends it and is kept. `seed`: one for
    the batch, or one per row."""
    if sampling.temperature <= 0:
        raise MudpuppyError(f"sampling temperature must be above 0, got {sampling.temperature}")
    if any(len(p) == 0 for p in prompts):
        raise MudpuppyError("sample: every prompt needs at least one token")
    results: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens <= 0:
        return results
    seeds = [seed] * len(prompts) if isinstance(seed, int) else [int(s) for s in seed]
    if len(seeds) != len(prompts):
        raise ValueError(f"sample: {len(seeds)} seeds for {len(prompts)} prompts")
    keys = {s: mx.random.key(s % 2**64) for s in dict.fromkeys(seeds)}
    for rows in batches(handle, prompts):
        streams: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            streams.setdefault(seeds[row], []).append(i)
        batch_keys = []
        for s in streams:
            keys[s], batch_key = mx.random.split(keys[s])
            batch_keys.append(batch_key)
        outs = sample_batch(handle, [prompts[r] for r in rows], max_new_tokens, set(stop_ids), sampling,
                            Streams(batch_keys, list(streams.values())))
        for row, out in zip(rows, outs):
            results[row] = out
    return results


class Streams:
    """The keys of one batch's draws: one chain per seed, each drawing for its rows of the batch."""

    def __init__(self, keys: list, rows: list[list[int]]):
        self.keys, self.rows = keys, [mx.array(r) for r in rows]
        self.order = [i for r in rows for i in r]

    def draw(self, logits: mx.array, sampling: Sampling) -> mx.array:
        """One token id per row [B], each seed's rows from the next key of its chain."""
        parts = []
        for i, rows in enumerate(self.rows):
            self.keys[i], step_key = mx.random.split(self.keys[i])
            parts.append(draw(logits if len(self.rows) == 1 else logits[rows], sampling, step_key))
        if len(parts) == 1:
            return parts[0]
        tokens = mx.concatenate(parts)
        return tokens[mx.array(np.argsort(np.array(self.order)))]          # back to the batch's row order


def batches(handle, prompts: list[list[int]]) -> list[list[int]]:
    """Prompt indices per batch: all in one when left padding is exact for this model, else by length."""
    if left_paddable(handle):
        return [list(range(len(prompts)))]
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    return list(by_length.values())


def left_paddable(handle) -> bool:
    from mlx_lm.models.cache import KVCache, make_prompt_cache  # lazily, as elsewhere: mlx_lm imports transformers

    return handle.packable and all(type(c) is KVCache for c in make_prompt_cache(handle.model))


def batch_cache(model, pads: list[int]) -> list:
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    if any(pads):
        return [BatchKVCache(pads) for _ in make_prompt_cache(model)]
    return make_prompt_cache(model)    # equal lengths: the model's own caches take a batch as they are


def last_logits(handle, ids: mx.array, cache: list) -> mx.array:
    """[B, V] logits at each row's last position; the head runs on that position only when it can."""
    split = hidden_and_head(handle.model) if handle.split_head else None
    if split is None:
        return handle.model(ids, cache=cache)[:, -1]
    body, head = split
    return head(body(ids, cache)[:, -1])


def sample_batch(handle, prompts: list[list[int]], max_new_tokens: int, stop: set[int], sampling: Sampling,
                 streams: Streams) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    cache = batch_cache(handle.model, pads)
    logits = last_logits(handle, mx.array([[PAD_ID] * pad + p for pad, p in zip(pads, prompts)]), cache)
    outs: list[list[int]] = [[] for _ in prompts]
    running = [True] * len(prompts)
    for _ in range(max_new_tokens):
        tokens = streams.draw(logits, sampling)
        for row, token in enumerate(tokens.tolist()):
            if running[row]:
                outs[row].append(token)
                running[row] = token not in stop and len(outs[row]) < max_new_tokens
        if not any(running):
            break
        logits = last_logits(handle, tokens[:, None], cache)
    return outs
