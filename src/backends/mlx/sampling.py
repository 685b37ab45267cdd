"""The sampler: transformers' warpers in transformers' order, then one keyed categorical draw.

Each cut follows its transformers warper to the letter (TopKLogitsWarper,
TopPLogitsWarper, MinPLogitsWarper with min_tokens_to_keep=1), so a
configuration means the same thing on torch and MLX: ties at the k-th
logit survive top-k; top-p drops the low tail whose cumulative probability
stays at or below 1 - top_p; min-p compares with the most likely token.
A cut token's logit becomes -inf and takes no part in the next cut.
"""

from __future__ import annotations

import mlx.core as mx

from ..protocol import Sampling

NEG_INF = float("-inf")


def filter_logits(logits: mx.array, sampling: Sampling) -> mx.array:
    """Float32 [B, V] logits / temperature, with the tokens the cuts drop at -inf."""
    scores = logits.astype(mx.float32) / sampling.temperature
    vocab = scores.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = mx.topk(scores, sampling.top_k, axis=-1).min(axis=-1, keepdims=True)
        scores = mx.where(scores < kth, NEG_INF, scores)
    if sampling.top_p < 1.0:
        order = mx.argsort(scores, axis=-1)                       # ascending, as transformers sorts
        ascending = mx.take_along_axis(scores, order, axis=-1)
        cumulative = mx.cumsum(mx.softmax(ascending, axis=-1), axis=-1)
        drop = (cumulative <= 1.0 - sampling.top_p) & (mx.arange(vocab) < vocab - 1)  # the top one stays
        drop = mx.put_along_axis(mx.zeros(scores.shape, dtype=mx.bool_), order, drop, axis=-1)
        scores = mx.where(drop, NEG_INF, scores)
    if sampling.min_p is not None:
        probs = mx.softmax(scores, axis=-1)
        top = mx.argmax(probs, axis=-1, keepdims=True)
        drop = (probs < sampling.min_p * probs.max(axis=-1, keepdims=True)) & (mx.arange(vocab) != top)
        scores = mx.where(drop, NEG_INF, scores)
    return scores


def draw(logits: mx.array, sampling: Sampling, key: mx.array) -> mx.array:
    """One token id per row [B] (uint32), from this key alone: MLX's global random state is not read."""
    return mx.random.categorical(filter_logits(logits, sampling), axis=-1, key=key)
