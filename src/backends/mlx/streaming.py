"""Streaming on MLX: the backend's loops, one token at a time.

Greedy decoding is `MlxBackend.generate`'s loop (one prompt, a KV cache, argmax);
sampling is `generation.sample_batch` for a single row, with the keys split as
`generation.sample` splits them, so a seed draws the ids `MlxBackend.sample` draws.
mlx-lm's `stream_generate` is not used: its sampler is not the protocol's (transformers'
warpers in transformers' order, keyed by the seed alone), so a seeded answer would
differ between `chat` and the protocol.
"""

from __future__ import annotations

import mlx.core as mx

from ...errors import MudpuppyError
from .forward import eval_mode
from .generation import batch_cache, last_logits
from .sampling import draw


def stream_ids(backend, handle, prompt, max_new_tokens, stop_ids, sampling, seed, on_token) -> None:
    with eval_mode(handle.model):
        if sampling is None:
            greedy(handle, prompt, max_new_tokens, set(stop_ids), on_token)
        else:
            sampled(handle, prompt, max_new_tokens, set(stop_ids), sampling, seed, on_token)


def greedy(handle, prompt, max_new_tokens, stop, on_token) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    model = handle.model
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)
    for produced in range(1, max_new_tokens + 1):
        token = int(mx.argmax(logits[0, -1]).item())
        if not on_token(token) or token in stop or produced == max_new_tokens:
            return
        logits = model(mx.array([[token]]), cache=cache)


def sampled(handle, prompt, max_new_tokens, stop, sampling, seed, on_token) -> None:
    if sampling.temperature <= 0:
        raise MudpuppyError(f"sampling temperature must be above 0, got {sampling.temperature}")
    _, key = mx.random.split(mx.random.key(seed % 2**64))     # generation.sample's key for its first batch
    cache = batch_cache(handle.model, [0])
    logits = last_logits(handle, mx.array([prompt]), cache)
    for produced in range(1, max_new_tokens + 1):
        key, step_key = mx.random.split(key)
        tokens = draw(logits, sampling, step_key)
        token = int(tokens.tolist()[0])
        if not on_token(token) or token in stop or produced == max_new_tokens:
            return
        logits = last_logits(handle, tokens[:, None], cache)
