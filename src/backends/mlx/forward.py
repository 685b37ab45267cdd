"""Forward passes on MLX: attention masks, the token loss, logits.

mlx-lm models build their own causal mask and take no mask argument. They
do ask each layer's cache for one (``cache.make_mask``), so a cache that
stores nothing and answers with our mask lets us run any mask through an
unmodified model: a padding mask (logits that match torch at every
position) or the block-diagonal mask of packed rows.

Packed rows keep their positions contiguous instead of restarting per
example. With rotary embeddings attention depends only on q - k, which is
the same either way inside a segment, and the mask stops attention across
segments: exact, up to the float rounding of larger rotation angles. A
model with learned absolute positions would see shifted positions, so
packing is refused for it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx import nn

from ...errors import MudpuppyError
from .router_loss import router_aux_loss, router_tape

IGNORE_INDEX = -100


class MaskCache:
    """A stand-in KV cache for one full-sequence pass: keeps nothing, hands the model our mask."""

    offset = 0

    def __init__(self, mask: mx.array):
        self.mask = mask                      # bool [B, 1, T, T], True = may attend

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        if window_size is None:
            return self.mask
        q = mx.arange(n)[:, None]
        return self.mask & (q < mx.arange(n)[None] + window_size)  # sliding-window layers keep their window

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return keys, values


def causal_mask(attention_mask: np.ndarray, segment_ids: np.ndarray | None) -> mx.array:
    """[B, 1, T, T] bool: causal, within one segment when packed, never onto padding keys.

    Padding is its own segment (0) in a packed row, so no row is empty; in a
    padded batch a padding query sees the real tokens before it, as torch's
    sdpa mask does, which keeps even padding logits identical across backends.
    """
    width = attention_mask.shape[1]
    causal = np.tril(np.ones((width, width), dtype=bool))
    if segment_ids is not None:
        allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal
    else:
        allowed = causal[None] & attention_mask.astype(bool)[:, None, :]
        # A left-padding query sees no key at all; let it see itself, or its softmax is NaN
        # and 0 * NaN reaches the real tokens through the values.
        empty = ~allowed.any(axis=-1, keepdims=True)
        allowed |= empty & np.eye(width, dtype=bool)[None]
    return mx.array(allowed[:, None])


@contextlib.contextmanager
def eval_mode(model):
    """Eval mode (no dropout) for the duration, then the mode the trainer left."""
    training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(training)


def model_caches(model: nn.Module, mask: mx.array | None):
    return None if mask is None else [MaskCache(mask) for _ in model.layers]


def batch_mask(handle, batch, exact_padding: bool) -> mx.array | None:
    """The mask a batch needs, or None for the model's built-in causal mask.

    Right padding never reaches a real token under a causal mask, so training
    and loss use the built-in (fastest) path; `exact_padding` asks for the
    padding mask too, for logits compared position by position. Any other
    padding (left, or holes) always gets the exact mask.
    """
    packed = getattr(batch, "segment_ids", None) is not None
    if packed and not handle.packable:
        why = ("does not accept an attention mask" if not handle.masks
               else "has no rotary embeddings, so positions cannot restart per example")
        raise MudpuppyError(f"data.packing: this model's MLX implementation {why}, so packed examples "
                            "cannot be kept apart exactly; set data.packing: false")
    if packed:
        return causal_mask(batch.attention_mask, batch.segment_ids)
    attention = np.asarray(batch.attention_mask)
    if attention.all():
        return None
    if not handle.masks:
        if right_padded(attention):
            return None
        raise MudpuppyError("this model's MLX implementation does not accept an attention mask, "
                            "so a batch padded on the left cannot be computed exactly; pad on the right")
    if exact_padding or not right_padded(attention):
        return causal_mask(attention, None)
    return None


def right_padded(attention: np.ndarray) -> bool:
    """Every row is real tokens followed by padding."""
    return bool((np.diff(attention.astype(np.int8), axis=1) <= 0).all())


def hidden_and_head(model: nn.Module):
    """(body, head) when the model is body-then-linear-head, the head including what the model's
    `__call__` applies after it (post_head); else None. check_forward_paths proves the pair against
    the model's own forward before any loss uses it."""
    inner = getattr(model, "model", None)
    if inner is None or not callable(inner):
        return None
    after = post_head(model)
    if "lm_head" in model:
        return (lambda ids, cache: inner(ids, cache)), (lambda h: after(model.lm_head(h)))
    args = getattr(model, "args", None)
    # Tied (Gemma 2 declares no tie_word_embeddings and always ties): the proof catches a wrong guess.
    if getattr(args, "tie_word_embeddings", True) and hasattr(getattr(inner, "embed_tokens", None), "as_linear"):
        return (lambda ids, cache: inner(ids, cache)), (lambda h: after(inner.embed_tokens.as_linear(h)))
    return None


def post_head(model: nn.Module):
    """The operation mlx-lm's `__call__` applies to the head's output, from the constants the model
    holds (mlx-lm 0.32): Gemma 2's soft-capping (`final_logit_softcapping`), Granite's division
    (`logits_scaling`), Cohere's multiplier (`model.args.logit_scale`); identity otherwise. A model
    that does something else fails check_forward_paths' proof and computes full logits instead."""
    cap = getattr(model, "final_logit_softcapping", None)
    if isinstance(cap, (int, float)) and cap:
        return lambda out: mx.tanh(out / cap) * cap
    scaling = getattr(model, "logits_scaling", None)
    if isinstance(scaling, (int, float)) and scaling:
        return lambda out: out / scaling
    scale = getattr(getattr(getattr(model, "model", None), "args", None), "logit_scale", None)
    if isinstance(scale, (int, float)):
        return lambda out: out * scale
    return lambda out: out


def head_module(model: nn.Module) -> nn.Module:
    """The module whose weights the head of `hidden_and_head` applies: lm_head, or the tied embedding."""
    return model.lm_head if "lm_head" in model else model.model.embed_tokens


def uses_rotary_positions(model: nn.Module) -> bool:
    """Rotary embeddings and no learned absolute positions (GPT-2's wpe and the like)."""
    kinds = [type(m).__name__.lower() for _, m in model.named_modules()]
    names = [name.rsplit(".", 1)[-1] for name, _ in model.named_modules()]
    absolute = any(n in ("wpe", "embed_positions", "position_embeddings") for n in names)
    return any("rope" in k or "rotary" in k for k in kinds) and not absolute


def check_forward_paths(model: nn.Module) -> tuple[bool, bool]:
    """(split head, masks): which paths give the model's own logits, proved on a 5-token input.

    Some architectures scale or cap logits after the head (Gemma 2, Granite,
    Cohere): post_head applies the same; one it does not know falls back to
    full logits. A model that ignores the mask cache
    gets no exact padding logits and cannot pack.
    """
    ids = mx.array([[1, 2, 3, 4, 5]])
    reference = model(ids)
    split = hidden_and_head(model)
    split_ok = False
    if split is not None:
        try:
            body, head = split
            split_ok = bool(mx.array_equal(head(body(ids, None)), reference).item())
        except (TypeError, ValueError, AttributeError):
            split_ok = False
    try:
        diagonal = mx.array(np.eye(5, dtype=bool)[None, None])
        blocked = model(ids, cache=model_caches(model, diagonal))
        causal = model(ids, cache=model_caches(model, mx.array(np.tril(np.ones((5, 5), bool))[None, None])))
        # The causal mask must reproduce the model, and a different mask must change it.
        masks_ok = (bool(mx.allclose(causal, reference, atol=1e-5, rtol=1e-5).item())
                    and not bool(mx.allclose(blocked, reference, atol=1e-5, rtol=1e-5).item()))
    except (TypeError, ValueError, AttributeError):
        masks_ok = False
    return split_ok, masks_ok


@dataclass
class TokenTargets:
    """The host side of a token-loss forward: what to run and where the targets are (numpy)."""

    input_ids: np.ndarray        # [B, T]
    keep: np.ndarray             # flat positions (row-major over [B, T]) that carry a target
    targets: np.ndarray          # the target id at each of them
    mask: mx.array | None        # the attention mask the batch needs, or None for the built-in causal one

    @property
    def rows(self) -> np.ndarray:
        return self.keep // self.input_ids.shape[1]


def token_targets(handle, batch) -> TokenTargets:
    labels = np.asarray(batch.labels)
    flat = labels.reshape(-1)
    keep = np.flatnonzero(flat != IGNORE_INDEX)
    return TokenTargets(np.asarray(batch.input_ids), keep, flat[keep],
                        batch_mask(handle, batch, exact_padding=False))


def logprobs_at(handle, input_ids: mx.array, positions: mx.array, targets: mx.array,
                mask: mx.array | None) -> mx.array:
    """log p(target) at the flat `positions` of the batch: a pure function of its arrays, which is
    what lets the compiled step (compiled.py) trace it once per shape."""
    model = handle.model
    cache = model_caches(model, mask)
    split = hidden_and_head(model) if handle.split_head else None
    if split is not None:
        body, head = split
        hidden = body(input_ids, cache)
        logits = head(hidden.reshape(-1, hidden.shape[-1])[positions])
    else:
        logits = model(input_ids, cache=cache)
        logits = logits.reshape(-1, logits.shape[-1])[positions]
    return -nn.losses.cross_entropy(logits.astype(mx.float32), targets, reduction="none")


def target_logprobs(handle, batch) -> tuple[mx.array, np.ndarray]:
    """log p(target) at every position whose label is not -100 (row-major), and each one's row.

    As on torch, only positions with a target go through the output head:
    a chat example whose answer is 5 tokens costs 5 rows of vocabulary
    logits, not one per token. The positions are picked in numpy, so MLX
    sees a plain gather.
    """
    t = token_targets(handle, batch)
    logprobs = logprobs_at(handle, mx.array(t.input_ids), mx.array(t.keep.astype(np.uint32)),
                           mx.array(t.targets), t.mask)
    return logprobs, t.rows


def loss_sum(handle, batch, router_aux: bool = False) -> mx.array:
    """Summed cross-entropy over the loss-carrying tokens of a batch. With `router_aux`, where the run
    adds a router load-balancing loss (router_loss.py), that term once per loss token, as on torch:
    the mean over tokens is then the model's own loss."""
    with router_tape(router_aux and handle.router_aux_coef > 0) as tape:
        logprobs, _ = target_logprobs(handle, batch)
    total = -logprobs.sum()
    if tape is not None and logprobs.size:
        total = total + router_aux_loss(handle, tape, batch) * logprobs.size
    return total


def sequence_logprobs(handle, batch) -> tuple[mx.array, np.ndarray]:
    """(summed log p(target) per row [B], loss-carrying tokens per row [B])."""
    logprobs, rows = target_logprobs(handle, batch)
    n_rows = np.asarray(batch.labels).shape[0]
    sums = mx.zeros((n_rows,), dtype=mx.float32).at[mx.array(rows.astype(np.uint32))].add(logprobs)
    return sums, np.bincount(rows, minlength=n_rows)


def logits(handle, batch) -> np.ndarray:
    model = handle.model
    out = model(mx.array(batch.input_ids), cache=model_caches(model, batch_mask(handle, batch, exact_padding=True)))
    return np.array(out.astype(mx.float32))


def head_logits(handle, batch) -> mx.array:
    """A scalar-head model's float32 logits [B, T, classes]. Right padding needs no mask: the
    positions read are real tokens, which never see a later (padding) one."""
    model = handle.model
    out = model(mx.array(batch.input_ids), cache=model_caches(model, batch_mask(handle, batch, exact_padding=False)))
    return out.astype(mx.float32)


def last_real_token(input_ids: np.ndarray, pad_token_id: int | None) -> np.ndarray:
    """Per row, the rightmost position whose id is not the pad id: transformers' rule, kept to the
    letter (an end token equal to the pad id counts as padding there too), so scores match."""
    ids = np.asarray(input_ids)
    if pad_token_id is None:
        return np.full(ids.shape[0], ids.shape[1] - 1)
    return (np.arange(ids.shape[1]) * (ids != pad_token_id)).argmax(axis=-1)


def sequence_scores(handle, batch) -> mx.array:
    """The score per row [B], read at each row's last real token."""
    logits = head_logits(handle, batch)
    rows = np.arange(logits.shape[0])
    last = last_real_token(batch.input_ids, handle.tokenizer.pad_token_id)
    return logits[mx.array(rows), mx.array(last), 0]


def token_scores(handle, batch) -> mx.array:
    """Logits [N, classes] where labels != -100, row-major (as torch's boolean indexing)."""
    logits = head_logits(handle, batch)
    keep = np.flatnonzero(np.asarray(batch.labels).reshape(-1) != IGNORE_INDEX)
    return logits.reshape(-1, logits.shape[-1])[mx.array(keep.astype(np.uint32))]
