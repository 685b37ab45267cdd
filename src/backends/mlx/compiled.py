"""`training.compile: true` on MLX: the SFT step's loss and gradient under `mx.compile`.

What is compiled, and why so:

- The whole micro-batch `value_and_grad`, forward and backward together.
  Compiling only the forward would do nothing for training: under a
  gradient transform MLX runs a compiled function as plain Python again.
- Only SFT's token loss. A compiled function must be a function of its
  array arguments; the token loss is (`forward.logprobs_at`), once the
  batch is turned into ids, target positions and targets on the host.
  Preference and reward objectives compute from each batch in Python
  (numpy masks, per-row bookkeeping) and are refused by name instead.
- Shapes in buckets. A compiled function is traced again for every new
  input shape, and every batch has its own width and number of loss
  tokens. Widths and target counts are padded up to one of four sizes per
  doubling (at most 25% more, exact below 8), so a run sees a handful of
  shapes. Padding is exact: padding tokens go to the right of each row
  (a causal model never lets a real token see them; an explicit mask
  shuts them out), and padded targets carry weight 0.
- Random state is an input and an output of the compiled function, so
  dropout draws fresh masks each call, from the key the trainer seeds per
  step (a resumed run still draws what an uninterrupted one would). A
  width that was padded draws its masks over the padded shape: dropout
  masks then differ from the eager run's, with the same distribution.

Model and random state are captured as `inputs` and `outputs`: the
gradient transform swaps the trainable arrays into the model while it
traces, and the outputs put the real ones back.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx import nn

from .forward import TokenTargets, logprobs_at, token_targets


def bucket(n: int) -> int:
    """`n` rounded up to a multiple of 2**(bits(n) - 3): four sizes per doubling, exact up to 7."""
    step = 1 << max(n.bit_length() - 3, 0)
    return -(-n // step) * step


def position_limit(config: dict) -> int | None:
    """The longest sequence the model's positions are defined for, if the config says.

    Padding must not cross it: learned positions end there, and some rotary
    scalings (longrope) switch tables when a sequence passes the original length.
    """
    scaling = config.get("rope_scaling") or {}
    limits = [config.get(k) for k in ("max_position_embeddings", "n_positions", "original_max_position_embeddings")]
    limits.append(scaling.get("original_max_position_embeddings"))
    known = [int(v) for v in limits if isinstance(v, int) and v > 0]
    return min(known) if known else None


def padded_width(width: int, limit: int | None) -> int:
    """The bucketed width, never past the position limit (nor narrower than the batch)."""
    target = bucket(width)
    if limit is not None and target > limit:
        return max(width, limit)
    return target


def pad_mask(mask: mx.array, width: int) -> mx.array:
    """[B, 1, T, T] -> [B, 1, W, W]: no query sees a padding key; a padding query sees only itself
    (an empty row would make its softmax NaN)."""
    extra = width - mask.shape[-1]
    if extra == 0:
        return mask
    grown = mx.pad(mask, [(0, 0), (0, 0), (0, extra), (0, extra)], constant_values=False)
    new = mx.arange(width) >= mask.shape[-1]
    return grown | (mx.eye(width, dtype=mx.bool_) & new[:, None])


def padded_arrays(t: TokenTargets, limit: int | None) -> list[mx.array]:
    """ids [B, W], positions, targets and weights [N'] for the compiled loss, and the mask if any."""
    rows, width = t.input_ids.shape
    wide = padded_width(width, limit)
    ids = np.zeros((rows, wide), dtype=t.input_ids.dtype)
    ids[:, :width] = t.input_ids
    n = len(t.keep)
    count = min(bucket(max(n, 1)), rows * wide)
    positions = np.zeros(count, dtype=np.uint32)
    positions[:n] = (t.keep // width) * wide + t.keep % width   # the same token, in the wider row
    targets = np.zeros(count, dtype=t.targets.dtype)
    targets[:n] = t.targets
    weights = np.zeros(count, dtype=np.float32)
    weights[:n] = 1.0
    arrays = [mx.array(ids), mx.array(positions), mx.array(targets), mx.array(weights)]
    if t.mask is not None:
        arrays.append(pad_mask(t.mask, wide))
    return arrays


class CompiledTokenLoss:
    """((loss * scale, loss), gradients) of one micro-batch's summed token loss, compiled.

    The same values as `nn.value_and_grad(model, loss)` on the eager path,
    up to float rounding of the fused kernels and of sums over padded lengths.
    """

    def __init__(self, handle):
        self.handle = handle
        self.limit = position_limit(handle.config)
        model = handle.model
        value_and_grad = nn.value_and_grad(model, self._loss)
        state = [model.state, mx.random.state]
        # Two functions, so the built-in causal path (no mask) keeps its faster attention.
        self._plain = mx.compile(lambda *arrays: value_and_grad(model, *arrays), inputs=state, outputs=state)
        self._masked = mx.compile(lambda *arrays: value_and_grad(model, *arrays), inputs=state, outputs=state)

    def _loss(self, model, ids, positions, targets, weights, scale, mask=None):
        logprobs = logprobs_at(self.handle, ids, positions, targets, mask)
        loss = -(logprobs * weights).sum()
        return loss * scale, loss

    def __call__(self, batch, scale: float):
        ids, positions, targets, weights, *mask = padded_arrays(token_targets(self.handle, batch), self.limit)
        fn = self._masked if mask else self._plain
        return fn(ids, positions, targets, weights, mx.array(scale, dtype=mx.float32), *mask)
