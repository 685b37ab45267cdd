"""Per-token log-probs at a sampling temperature, the output head a chunk at a time (GRPO).

GRPO scores every completion token, so N (rows x completion length) runs
into the thousands and N x vocab float32 logits into gigabytes. The body
runs once over the batch; the head and the log-softmax then run on
CHUNK_ROWS target positions at a time.

Chunking a lazy graph is not enough on MLX. Evaluated in one go, the
chunks are scheduled side by side and all their logits are alive at once;
and under a gradient transform an evaluated array keeps its graph (it is a
tracer), so nothing computed for the head is freed before the backward;
`mx.checkpoint` around each chunk measured no better. So the head is one
custom function: its forward evaluates each chunk and keeps only the N
log-probs; its VJP takes each chunk's gradient in turn, recomputing that
chunk's logits (one more head pass: 1.3-1.5x the head's time on the CPU
build). Results leave each chunk through numpy, the one way to cut an MLX
array from its graph.

Measured on the CPU build, one-layer model, vocab 32000, frozen head (as under
LoRA), peak memory without / with gradient (the rest of N's growth is the body):

    N        lazy chunks          this
    4096     1.06 / 1.63 GB       0.13 / 0.35 GB
    16384    -    / 3.63 GB       0.28 / 0.76 GB

A chunk's backward holds about a dozen [CHUNK_ROWS, vocab] float32 arrays
(0.6 GB for a 49k vocabulary), hence 256 rows.

A model whose head cannot run apart from its body (forward.check_forward_paths)
gives full logits, which exist anyway; its log-softmax is not chunked.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .forward import head_module, hidden_and_head, model_caches, token_targets

CHUNK_ROWS = 256


def scored(logits: mx.array, targets: mx.array, temperature: float, entropy: bool):
    """(log p(target) [n], entropy [n] or None) of float32 logits / temperature."""
    scaled = logits.astype(mx.float32) / temperature
    logp = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    if not entropy:
        return picked, None
    return picked, mx.stop_gradient(-(mx.exp(logp) * logp).sum(axis=-1))   # a metric: no gradient


def token_logprobs(handle, batch, temperature: float, entropy: bool) -> tuple[mx.array, np.ndarray | None]:
    """log p(target) at every position whose label is not -100, row-major [N] float32, with the
    gradient the model's mode gives; and the entropy there as numpy when `entropy`.

    The positions are forward.token_targets', so these are exactly the terms
    sequence_logprobs sums at temperature 1.
    """
    t = token_targets(handle, batch)
    if len(t.keep) == 0:
        return mx.zeros((0,), dtype=mx.float32), (np.zeros(0, dtype=np.float32) if entropy else None)
    model = handle.model
    ids, cache = mx.array(t.input_ids), model_caches(model, t.mask)
    positions = mx.array(t.keep.astype(np.uint32))
    split = hidden_and_head(model) if handle.split_head else None
    if split is None:
        logits = model(ids, cache=cache)
        picked, ent = scored(logits.reshape(-1, logits.shape[-1])[positions], mx.array(t.targets), temperature,
                             entropy)
        return picked, (host(ent) if entropy else None)
    body, head = split
    hidden = body(ids, cache)
    rows = hidden.reshape(-1, hidden.shape[-1])[positions]
    return chunked_head(head_module(model), head, rows, t.targets, temperature, entropy)


def host(x: mx.array) -> np.ndarray:
    """Evaluated and copied out as float32 numpy (numpy has no bfloat16): what is left of x's graph."""
    return np.array(x.astype(mx.float32))


def chunked_head(module, head, rows: mx.array, targets: np.ndarray, temperature: float,
                 entropy: bool) -> tuple[mx.array, np.ndarray | None]:
    """log p(target) of head(rows) / temperature [N], and the entropies as numpy, a chunk at a time in
    the forward and in the backward. Gradient flows to `rows` and to the head's trainable weights
    (a full fine-tune's), which the custom function must take as inputs: it treats captured arrays
    as constants."""
    named = tree_flatten(module.trainable_parameters())
    names, weights = [k for k, _ in named], [v for _, v in named]
    spans = [slice(s, s + CHUNK_ROWS) for s in range(0, rows.shape[0], CHUNK_ROWS)]
    ys = [mx.array(targets[span]) for span in spans]
    entropies: list[np.ndarray] = []

    def logits_of(r, *params):
        if names:
            module.update(tree_unflatten(list(zip(names, params))))
        return head(r)

    def restore():
        if names:   # the transforms hand in copies of the weights; the module keeps its own
            module.update(tree_unflatten(list(zip(names, weights))))

    @mx.custom_function
    def forward(rows, params):
        entropies.clear()
        picked = []
        for span, y in zip(spans, ys):
            logp, ent = scored(logits_of(rows[span], *params), y, temperature, entropy)
            picked.append(host(logp))
            if entropy:
                entropies.append(host(ent))
        restore()
        return mx.array(np.concatenate(picked))

    @forward.vjp
    def backward(primals, cotangent, output):
        rows, params = primals
        d_rows, d_params = [], [np.zeros(p.shape, dtype=np.float32) for p in params]
        for span, y in zip(spans, ys):
            logits = logits_of(rows[span], *params)
            # d log p(y) / d logits = (one-hot(y) - softmax(logits / T)) / T, written out: fewer
            # [chunk, vocab] temporaries than differentiating the log-softmax and the gather.
            probs = mx.softmax(logits.astype(mx.float32) / temperature, axis=-1)
            onehot = mx.arange(probs.shape[-1])[None] == y[:, None]
            d_logits = (cotangent[span, None] / temperature) * (onehot - probs)
            # The head's own VJP; the head output it also returns is never evaluated, so not recomputed.
            _, grads = mx.vjp(logits_of, [rows[span], *params], [d_logits.astype(logits.dtype)])
            d_rows.append(host(grads[0]))
            for total, g in zip(d_params, grads[1:]):
                total += host(g)
        restore()
        return (mx.array(np.concatenate(d_rows)).astype(rows.dtype),
                [mx.array(g).astype(p.dtype) for g, p in zip(d_params, params)])

    picked = forward(rows, weights)
    return picked, (np.concatenate(entropies) if entropy else None)
