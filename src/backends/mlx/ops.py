"""`ArrayOps` on mx arrays: what training objectives (DPO, KTO, ...) compute with on MLX."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx import nn


class MlxOps:
    def from_numpy(self, array: np.ndarray) -> mx.array:
        array = np.asarray(array)
        return mx.array(array.astype(np.float32) if np.issubdtype(array.dtype, np.floating) else array)

    def to_numpy(self, x: mx.array) -> np.ndarray:
        return np.array(mx.stop_gradient(x).astype(mx.float32))

    def to_float(self, x: mx.array) -> float:
        return float(mx.stop_gradient(x).item())

    def detach(self, x: mx.array) -> mx.array:
        return mx.stop_gradient(x)

    def log_sigmoid(self, x):
        return nn.log_sigmoid(x)

    def sigmoid(self, x):
        return mx.sigmoid(x)

    def softplus(self, x):
        return nn.softplus(x)

    def exp(self, x):
        return mx.exp(x)

    def expm1(self, x):
        return mx.expm1(x)

    def log(self, x):
        return mx.log(x)

    def log1p(self, x):
        return mx.log1p(x)

    def log_softmax(self, x):
        return x - mx.logsumexp(x, axis=-1, keepdims=True)

    def pick(self, x, index: np.ndarray):
        idx = mx.array(np.asarray(index).astype(np.int32))
        return mx.take_along_axis(x, idx[:, None], axis=1)[:, 0]

    def take(self, x, index: np.ndarray):
        return x[mx.array(np.asarray(index).astype(np.int32))]

    def relu(self, x):
        return mx.maximum(x, 0)

    def clip(self, x, low=None, high=None):
        return mx.clip(x, low, high)

    def where(self, cond, a, b):
        return mx.where(cond, a, b)

    def concat(self, xs):
        return mx.concatenate(list(xs))

    def stack(self, xs):
        return mx.stack(list(xs))

    def sum(self, x):
        return x.sum()

    def mean(self, x):
        return x.mean()

    def minimum(self, a, b):
        return mx.minimum(a, b)

    def row_sum(self, x, rows: np.ndarray, n: int):
        # A scatter-add, as forward.sequence_logprobs sums per row: gradient flows to every x[i].
        index = mx.array(np.asarray(rows).astype(np.uint32))
        return mx.zeros((n,), dtype=mx.float32).at[index].add(x.astype(mx.float32))
