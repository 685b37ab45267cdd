"""`ArrayOps` on torch tensors: what training objectives compute with (see protocol.py)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


class TorchOps:
    def __init__(self, device: torch.device):
        self.device = device

    def from_numpy(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.as_tensor(np.asarray(array))
        if tensor.is_floating_point():
            tensor = tensor.float()
        return tensor.to(self.device)

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        return x.detach().float().cpu().numpy()

    def to_float(self, x: torch.Tensor) -> float:
        return float(x.detach())

    def detach(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    def log_sigmoid(self, x):
        return F.logsigmoid(x)

    def sigmoid(self, x):
        return torch.sigmoid(x)

    def softplus(self, x):
        return F.softplus(x)

    def exp(self, x):
        return torch.exp(x)

    def expm1(self, x):
        return torch.expm1(x)

    def log(self, x):
        return torch.log(x)

    def log1p(self, x):
        return torch.log1p(x)

    def log_softmax(self, x):
        return F.log_softmax(x, dim=-1)

    def pick(self, x, index: np.ndarray):
        idx = torch.as_tensor(np.asarray(index), dtype=torch.long, device=x.device)
        return x.gather(1, idx[:, None])[:, 0]

    def take(self, x, index: np.ndarray):
        return x[torch.as_tensor(np.asarray(index), dtype=torch.long, device=x.device)]

    def relu(self, x):
        return torch.relu(x)

    def clip(self, x, low=None, high=None):
        return torch.clamp(x, min=low, max=high)

    def where(self, cond, a, b):
        return torch.where(cond, a, b)

    def concat(self, xs):
        return torch.cat(list(xs))

    def stack(self, xs):
        return torch.stack(list(xs))

    def sum(self, x):
        return x.sum()

    def mean(self, x):
        return x.mean()

    def minimum(self, a, b):
        return torch.minimum(a, b)

    def row_sum(self, x, rows: np.ndarray, n: int):
        index = torch.as_tensor(np.asarray(rows), dtype=torch.long, device=x.device)
        return x.new_zeros(n, dtype=torch.float32).index_add(0, index, x.float())
