"""Distillation's per-token divergence on MLX (`BackendProtocol.token_divergence`), chunked as logprobs.py's
token log-probs are, for the same reason: a lazy graph of chunks keeps every chunk's logits alive, so the
student's head and the divergence are one custom function whose forward evaluates a chunk at a time and
keeps only the running sum, and whose VJP takes each chunk's gradient in turn, recomputing that chunk's
logits. The teacher runs once without gradient; its hidden states at the loss positions are kept
([N, hidden], not [N, vocab]) and its head runs on each chunk as it is needed.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .forward import eval_mode, head_module, hidden_and_head, model_caches, token_targets
from .logprobs import CHUNK_ROWS


def rows_and_head(handle, input_ids: mx.array, mask, positions: mx.array):
    """(rows at the loss positions, head(rows) -> logits): hidden states and the model's head where they
    split, else the full forward's logits at those positions and the identity."""
    model = handle.model
    cache = model_caches(model, mask)
    split = hidden_and_head(model) if handle.split_head else None
    if split is None:
        logits = model(input_ids, cache=cache)
        return logits.reshape(-1, logits.shape[-1])[positions], (lambda x: x)
    body, head = split
    hidden = body(input_ids, cache)
    return hidden.reshape(-1, hidden.shape[-1])[positions], head


def log_softmax(logits: mx.array, temperature: float) -> mx.array:
    scaled = logits.astype(mx.float32) / temperature
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def tail_bucket(logp: mx.array) -> mx.array:
    """[n, k] log-probs with log(1 - their summed probability) appended (TRL's `_add_tail_bucket`)."""
    mass = mx.minimum(mx.logsumexp(logp, axis=-1, keepdims=True), -1e-7)
    return mx.concatenate([logp, mx.log(-mx.expm1(mass))], axis=-1)


def token_divergence(handle, teacher, batch, divergence, grad: bool = True, temperature: float = 1.0,
                     top_k: int = 0) -> mx.array:
    t = token_targets(handle, batch)
    if len(t.keep) == 0:
        return mx.zeros((), dtype=mx.float32)
    ids, positions = mx.array(t.input_ids), mx.array(t.keep.astype(np.uint32))
    with eval_mode(teacher.model):
        t_rows, t_head = rows_and_head(teacher, ids, token_targets(teacher, batch).mask, positions)
        t_rows = mx.stop_gradient(t_rows)
        mx.eval(t_rows)
    spans = [slice(s, s + CHUNK_ROWS) for s in range(0, len(t.keep), CHUNK_ROWS)]

    def teacher_chunk(span):
        logp = mx.stop_gradient(log_softmax(t_head(t_rows[span]), temperature))
        if not top_k:
            return logp, None
        index = mx.argpartition(-logp, kth=min(top_k, logp.shape[-1]) - 1, axis=-1)[:, :top_k]
        return tail_bucket(mx.take_along_axis(logp, index, axis=-1)), index

    def chunk(student_logits, span):
        teacher_logp, index = teacher_chunk(span)
        student = log_softmax(student_logits, temperature)
        if index is not None:
            student = tail_bucket(mx.take_along_axis(student, index, axis=-1))
        return divergence(student, teacher_logp).sum(axis=-1).sum()     # the vocabulary first: float32 digits

    if not grad:
        with eval_mode(handle.model):
            s_rows, s_head = rows_and_head(handle, ids, t.mask, positions)
            total = sum(float(chunk(s_head(s_rows[span]), span)) for span in spans)
        return mx.array(total, dtype=mx.float32)
    s_rows, s_head = rows_and_head(handle, ids, t.mask, positions)
    return chunked(head_module(handle.model) if handle.split_head else None, s_head, s_rows, spans, chunk)


def chunked(module, head, rows: mx.array, spans: list[slice], chunk) -> mx.array:
    """sum over spans of chunk(head(rows[span]), span), evaluated a chunk at a time forwards and backwards;
    gradient to `rows` and to the head's trainable weights (which the custom function must take as inputs,
    as logprobs.chunked_head's)."""
    named = tree_flatten(module.trainable_parameters()) if module is not None else []
    names, weights = [k for k, _ in named], [v for _, v in named]

    def restore():
        if names:
            module.update(tree_unflatten(list(zip(names, weights))))

    def piece(span):
        def f(r, *params):
            if names:
                module.update(tree_unflatten(list(zip(names, params))))
            return chunk(head(r), span)
        return f

    @mx.custom_function
    def forward(rows, params):
        total = 0.0
        for span in spans:
            total += float(piece(span)(rows[span], *params))
        restore()
        return mx.array(total, dtype=mx.float32)

    @forward.vjp
    def backward(primals, cotangent, output):
        rows, params = primals
        d_rows, d_params = [], [np.zeros(p.shape, dtype=np.float32) for p in params]
        for span in spans:
            _, grads = mx.vjp(piece(span), [rows[span], *params], [cotangent])
            d_rows.append(np.array(grads[0].astype(mx.float32)))
            for acc, g in zip(d_params, grads[1:]):
                acc += np.array(g.astype(mx.float32))
        restore()
        return (mx.array(np.concatenate(d_rows)).astype(rows.dtype),
                [mx.array(g).astype(p.dtype) for g, p in zip(d_params, params)])

    return forward(rows, weights)
