"""Sampled generation on torch for online methods (GRPO): transformers' `generate`, seeded.

What it guarantees beyond a plain `generate(do_sample=True)` call:

- The sampling settings are exactly the run's. A checkpoint's
  generation_config.json can carry its own top_p, top_k or repetition
  penalty, which transformers merges into any value the caller leaves at
  its default; sampling here runs under a fresh GenerationConfig, so
  top_k: 0 means no cut even though transformers' own default is 50.
- The draw depends on the seed alone, and the global random state (which
  dropout draws from) is as it was before: the sampler runs inside
  `torch.random.fork_rng`. A resumed run therefore samples what an
  uninterrupted one would.
- A seed per row (a list): rows that share a seed draw together from a
  generator of their own, the others' draws never touch it, so their ids do
  not depend on what else is in the batch. GRPO gives each prompt's group
  its own seed, which is what lets a group sample the same completions on
  any rank of a distributed run. Rows sharing one seed draw exactly what the
  same rows would draw with that seed as an int (transformers' own sampling:
  the same warpers, then torch.multinomial); the draw is made by
  `SeededDraw`, a logits processor under greedy decoding, because `generate`
  takes no generator of its own.
- The ids returned are the ids sampled, each row cut after its first stop
  token (kept: it is what the model learns to stop with). Nothing is ever
  decoded and encoded again.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .decode_attention import packed_kv_heads_at_decode
from ..handle import unwrap


@functools.cache
def cache_kwarg() -> str:
    """What `generate` calls a cache handed to it: `cache` from transformers 5.2x, `past_key_values` before
    (still accepted, with a deprecation warning on every call)."""
    from transformers.generation import utils

    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


@torch.no_grad()
def sample(backend, handle, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
           sampling, seed: int | list[int]) -> list[list[int]]:
    """`seed`: one for the batch (one stream: transformers' sampling), or one per row (SeededDraw)."""
    from transformers import GenerationConfig, LogitsProcessorList

    model, device = handle.model, backend.plan.device
    pad = handle.tokenizer.pad_token_id
    ids, attn = left_padded(prompts, pad)
    common = dict(max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids), pad_token_id=pad,
                  repetition_penalty=1.0, use_cache=True)
    extra = {}
    if isinstance(seed, int):
        config = GenerationConfig(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                                  top_k=sampling.top_k, min_p=sampling.min_p, **common)
    else:
        if len(seed) != len(prompts):
            raise ValueError(f"sample: {len(seed)} seeds for {len(prompts)} prompts")
        config = GenerationConfig(do_sample=False, **common)       # greedy over SeededDraw's one-hot scores
        extra["logits_processor"] = LogitsProcessorList([SeededDraw(sampling, seed, device)])
    gpu = [device] if device.type == "cuda" else []
    training = model.training
    model.eval()
    ids, attn = ids.to(device), attn.to(device)
    try:
        with fresh_generation_config(model), torch.random.fork_rng(devices=gpu, device_type=device.type), \
                contiguous_head(model), packed_kv_heads_at_decode(device):
            if isinstance(seed, int):
                torch.manual_seed(seed)
            with backend._autocast(handle):
                cache = shared_prefill(model, prompts, ids, attn)
                if cache is not None:
                    extra[cache_kwarg()] = cache
                out = model.generate(input_ids=ids, attention_mask=attn, generation_config=config, **extra)
    finally:
        model.train(training)
    return [cut_after_stop(row, stop_ids) for row in out[:, ids.shape[1]:].tolist()]


def shared_prefill(model, prompts: list[list[int]], ids: torch.Tensor, attn: torch.Tensor):
    """The KV cache of every row's prompt but its last token, computed once per distinct prompt and
    repeated to the rows that share it; None where no prompt repeats (or the model's cache cannot be
    repeated), and `generate` prefills as usual.

    GRPO samples each prompt `num_generations` times: its 8 identical prefills were a tenth of a
    sampling call (benchmarks/grpo_cpu.py). `generate` given this cache runs only the last prompt token
    of each row before decoding, with the positions and mask it would have used: the distinct rows keep
    the batch's left padding and their positions are counted from the mask, as `generate` counts them."""
    from transformers import DynamicCache

    first: dict[tuple, int] = {}
    index = [first.setdefault(tuple(p), len(first)) for p in prompts]
    if len(first) == len(prompts) or ids.shape[1] < 2:
        return None
    rows = torch.tensor([index.index(u) for u in range(len(first))], device=ids.device)
    u_ids, u_attn = ids[rows, :-1], attn[rows, :-1]
    positions = (u_attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=u_ids, attention_mask=u_attn, position_ids=positions, use_cache=True)
    cache = getattr(out, "cache", None)
    cache = getattr(out, "past_key_values", None) if cache is None else cache
    if not isinstance(cache, DynamicCache):
        return None
    cache.reorder_cache(torch.tensor(index, device=ids.device))
    return cache


class SeededDraw:
    """A logits processor that samples: transformers' warpers in the order `generate` applies them when
    sampling (temperature, top-k, top-p, min-p; min_tokens_to_keep 1), its softmax, then torch.multinomial
    for the rows of each seed from that seed's own generator. It returns 0 at the drawn token and -inf
    elsewhere, which greedy decoding then picks."""

    def __init__(self, sampling, seeds: list[int], device: torch.device):
        from transformers import (
            LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
        )

        warpers = []
        if sampling.temperature is not None and sampling.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k is not None and sampling.top_k != 0:
            warpers.append(TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
        if sampling.top_p is not None and sampling.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))
        if sampling.min_p is not None:
            warpers.append(MinPLogitsWarper(min_p=sampling.min_p, min_tokens_to_keep=1))
        self.warpers = LogitsProcessorList(warpers)
        rows: dict[int, list[int]] = {}
        for row, s in enumerate(seeds):
            rows.setdefault(int(s), []).append(row)
        # A generator per seed, seeded as `sample` seeds the global one for an int seed (negative seeds wrap
        # as torch.manual_seed wraps them): rows sharing a seed draw what they would draw with it as an int.
        self.streams = [(torch.Generator(device=device).manual_seed(s % 2**64),
                         torch.tensor(r, dtype=torch.long, device=device)) for s, r in rows.items()]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.nn.functional.softmax(self.warpers(input_ids, scores), dim=-1)
        tokens = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
        for generator, rows in self.streams:
            tokens[rows] = torch.multinomial(probs[rows], num_samples=1, generator=generator).squeeze(1)
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0.0)


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attn[row, width - len(p):] = 1
    return ids, attn


def cut_after_stop(row: list[int], stop_ids: list[int]) -> list[int]:
    """The row up to and including its first stop token (the rest is padding), or all of it."""
    stop = set(stop_ids)
    end = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
    return row[:end]


@contextlib.contextmanager
def fresh_generation_config(model):
    """The model's generation_config replaced by transformers' defaults for the duration."""
    from transformers import GenerationConfig

    base = unwrap(model)
    saved = getattr(base, "generation_config", None)
    base.generation_config = GenerationConfig()
    try:
        yield
    finally:
        base.generation_config = saved


@contextlib.contextmanager
def contiguous_head(model):
    """The output head's input made contiguous while generating.

    transformers' generate runs the head on the prefill's last position, a strided [B, 1, H] view:
    torch.matmul cannot fold a non-contiguous batch into one matrix product, so it copies the
    [H, vocab] weight once per row and runs a batched product (1.5 s of a 7.7 s GRPO sampling call
    on SmolLM2-135M, bf16, one CPU thread; 10 ms once contiguous). Under autocast the cast to bf16
    happens to copy; a model already in bf16 has nothing that does (benchmarks/grpo_cpu.py)."""
    head = unwrap(model).get_output_embeddings() if hasattr(unwrap(model), "get_output_embeddings") else None
    if head is None:
        yield
        return

    def make_contiguous(_module, args):
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and not x.is_contiguous():
            return (x.contiguous(), *args[1:])
        return None

    hook = head.register_forward_pre_hook(make_contiguous)
    try:
        yield
    finally:
        hook.remove()


@torch.no_grad()
def greedy(backend, handle, prompts: list[list[int]], max_new_tokens: int,
           stop_ids: list[int]) -> list[list[int]]:
    """Greedy decoding, prompts left-padded into one batch."""
    handle.model.eval()
    pad = handle.tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        attn[row, width - len(p):] = 1
    with backend._autocast(handle), contiguous_head(handle.model), packed_kv_heads_at_decode(backend.plan.device):
        out = handle.model.generate(
            input_ids=ids.to(backend.plan.device), attention_mask=attn.to(backend.plan.device),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop_ids,
            pad_token_id=pad, use_cache=True,
        )
    results = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stop_ids), len(row))
        results.append(row[:cut])
    return results
