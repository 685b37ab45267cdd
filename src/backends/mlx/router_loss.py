"""A mixture-of-experts router's load-balancing loss on MLX, as transformers' models add it.

mlx-lm's mixture-of-experts models compute no auxiliary loss. Where the run adds
one (routing.router_aux_coefficient), each router (the nn.Linear beside a
SwitchGLU, experts.router_paths) is given a class that also writes its logits
to the active tape, and `router_aux_loss` reduces them exactly as
transformers' ``load_balancing_loss_func`` does (Qwen3-MoE, Mixtral and gpt-oss
share it): per layer, softmax over the raw logits, the top-k experts counted per
token (no gradient), the probabilities summed per expert, padding left out by
the batch's [B, T] attention mask; then
``num_experts * sum(tokens_per_expert * probability_per_expert)`` over all layers'
rows, times the coefficient. The class keeps every parameter at its path, so
saving, conversion and adapters see the router they saw before.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np
from mlx import nn

from .experts import router_paths

_tape: list | None = None          # the router logits of the forward running now, when one is recording
_classes: dict[type, type] = {}


def recording_class(base: type) -> type:
    """`base` (nn.Linear, nn.QuantizedLinear) whose call also writes its output to the active tape."""
    if base not in _classes:
        def __call__(self, x):
            out = base.__call__(self, x)
            if _tape is not None:
                _tape.append(out)
            return out

        _classes[base] = type(f"Recording{base.__name__}", (base,), {"__call__": __call__})
    return _classes[base]


def record_routers(model: nn.Module) -> int:
    """Give each router of `model` the recording class; returns how many it found."""
    modules = dict(model.named_modules())
    paths = router_paths(model)
    for path in paths:
        module = modules[path]
        if type(module) not in _classes.values():
            module.__class__ = recording_class(type(module))
    return len(paths)


@contextlib.contextmanager
def router_tape(active: bool):
    """A list that receives every router's logits of the forwards run inside (nothing when not `active`)."""
    global _tape
    previous, _tape = _tape, ([] if active else None)
    try:
        yield _tape
    finally:
        _tape = previous


def router_aux_loss(handle, logits: list, batch) -> mx.array:
    """``coef * load_balancing_loss_func(logits, num_experts, top_k, attention_mask)`` in float32."""
    config = handle.config.get("text_config") or handle.config
    experts = config.get("num_experts") or config["num_local_experts"]
    top_k = config["num_experts_per_tok"]
    if not logits:
        return mx.zeros(())
    attention = getattr(batch, "attention_mask", None)
    mask = (mx.array(np.asarray(attention, dtype=np.float32).reshape(-1))
            if attention is not None and np.ndim(attention) == 2 else None)
    counts = mx.zeros((experts,), dtype=mx.float32)
    probs = mx.zeros((experts,), dtype=mx.float32)
    rows = 0.0
    ids = mx.arange(experts)
    for layer in logits:
        p = mx.softmax(layer.reshape(-1, experts).astype(mx.float32), axis=-1)
        chosen = mx.stop_gradient(mx.argpartition(-p, kth=top_k - 1, axis=-1)[:, :top_k])
        picked = (chosen[..., None] == ids).astype(mx.float32).sum(axis=1)      # [N, E]: top-k counts
        if mask is not None:
            picked, p = picked * mask[:, None], p * mask[:, None]
            rows = rows + mask.sum()
        else:
            rows = rows + p.shape[0]
        counts = counts + mx.stop_gradient(picked.sum(axis=0))
        probs = probs + p.sum(axis=0)
    loss = mx.sum((counts / rows) * (probs / rows)) * experts
    return handle.router_aux_coef * loss
