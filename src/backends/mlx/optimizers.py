"""The optimizers of `training.optimizer`, with torch's update rules on MLX.

- adamw: mlx's AdamW with bias correction switched on (mlx leaves it off by
  default; torch.optim.AdamW always corrects), torch's eps, decoupled decay;
- sgd: mlx's SGD; with momentum its first step uses the gradient itself,
  as torch's does;
- adafactor: torch.optim.Adafactor's algorithm, written here, because mlx's
  Adafactor is the original paper's (relative step sizes, update clipping
  by RMS of the parameter scale), a different optimizer with the same name.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_map_with_path

from ...errors import MudpuppyError

ADAM_EPS = 1e-8  # torch.optim.AdamW's default


def build_optimizer(cfg) -> optim.Optimizer:
    ratio = getattr(cfg, "loraplus_lr_ratio", None)
    if cfg.optimizer == "adamw":
        cls, kwargs = optim.AdamW, dict(betas=[cfg.adam_beta1, cfg.adam_beta2], eps=ADAM_EPS,
                                        weight_decay=cfg.weight_decay, bias_correction=True)
    elif cfg.optimizer == "sgd":
        cls, kwargs = optim.SGD, dict(momentum=getattr(cfg, "momentum", 0.0), weight_decay=cfg.weight_decay)
    elif cfg.optimizer == "adafactor":
        cls, kwargs = TorchAdafactor, dict(weight_decay=cfg.weight_decay)
    else:
        raise MudpuppyError(f"training.optimizer {cfg.optimizer!r} is not available on MLX; use adamw, sgd or "
                            "adafactor")
    if ratio is not None:
        return loraplus(cls)(learning_rate=cfg.learning_rate, loraplus_lr_ratio=ratio, **kwargs)
    return cls(learning_rate=cfg.learning_rate, **kwargs)


@functools.cache
def loraplus(cls: type) -> type:
    """`cls` with LoRA+'s rates, as torch's param groups (torch/optimizers.py: loraplus_groups) give them: a
    LoRA B matrix (lora_b, experts' lora_b) or a 1-D tensor (DoRA's m, a bias) steps at learning_rate times
    the ratio, a bias without weight decay; everything else at learning_rate. The state keeps its layout."""

    class LoraPlus(cls):
        def __init__(self, *, loraplus_lr_ratio: float, **kwargs):
            super().__init__(**kwargs)
            self.loraplus_lr_ratio = loraplus_lr_ratio

        def apply_gradients(self, gradients: dict, parameters: dict):
            if not self._initialized:
                self.init(gradients)
            for name, scheduler in self._schedulers.items():
                self.state[name] = scheduler(self.step)
            self.state["step"] = self.step + 1
            rate, decay = self.learning_rate, getattr(self, "weight_decay", 0.0)

            def one(path, gradient, parameter, state):
                leaf = path.rsplit(".", 1)[-1]
                fast = leaf == "lora_b" or parameter.ndim == 1
                self.state["learning_rate"] = rate * self.loraplus_lr_ratio if fast else rate
                if hasattr(self, "weight_decay"):
                    self.weight_decay = 0.0 if leaf == "bias" else decay
                return self.apply_single(gradient, parameter, state)

            try:
                return tree_map_with_path(one, gradients, parameters, self.state)
            finally:
                self.state["learning_rate"] = rate
                if hasattr(self, "weight_decay"):
                    self.weight_decay = decay

    LoraPlus.__name__ = LoraPlus.__qualname__ = f"LoraPlus{cls.__name__}"
    return LoraPlus


class TorchAdafactor(optim.Optimizer):
    """torch.optim.Adafactor (defaults beta2_decay -0.8, eps (None, 1e-3), d 1): factored second moments.

    Factoring works on the last two dimensions, and the estimate of a
    transposed matrix is the transpose of the estimate, so the [in, r]
    LoRA matrices of MLX update exactly as PEFT's [r, in] ones do.
    """

    def __init__(self, learning_rate: float, weight_decay: float = 0.0, beta2_decay: float = -0.8,
                 eps2: float = 1e-3, d: float = 1.0):
        super().__init__()
        self._maybe_schedule("learning_rate", learning_rate)
        self.weight_decay, self.beta2_decay, self.eps2, self.d = weight_decay, beta2_decay, eps2, d

    def init_single(self, parameter: mx.array, state: dict):
        if parameter.ndim > 1:
            state["row_var"] = mx.zeros(parameter.shape[:-1] + (1,), dtype=parameter.dtype)
            state["col_var"] = mx.zeros(parameter.shape[:-2] + (1,) + parameter.shape[-1:], dtype=parameter.dtype)
        else:
            state["variance"] = mx.zeros_like(parameter)

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict):
        lr = self.learning_rate.astype(mx.float32)
        step = self.step.astype(mx.float32)
        beta = step ** self.beta2_decay                       # torch's one_minus_beta2_t
        rho = mx.minimum(lr, mx.rsqrt(step))
        alpha = mx.maximum(self.eps2, mx.sqrt(mx.mean(mx.square(parameter)))) * rho
        if self.weight_decay:
            parameter = parameter * (1 - lr * self.weight_decay)
        eps1 = mx.finfo(parameter.dtype).eps
        squared = mx.square(gradient)
        if gradient.ndim > 1:
            row = state["row_var"] + beta * (mx.mean(squared, axis=-1, keepdims=True) - state["row_var"])
            col = state["col_var"] + beta * (mx.mean(squared, axis=-2, keepdims=True) - state["col_var"])
            state["row_var"], state["col_var"] = row, col
            estimate = (row @ col) / mx.maximum(mx.mean(row, axis=-2, keepdims=True), eps1)
        else:
            estimate = state["variance"] + beta * (squared - state["variance"])
            state["variance"] = estimate
        update = mx.rsqrt(mx.maximum(estimate, eps1 * eps1)) * gradient
        denom = mx.maximum(1.0, mx.sqrt(mx.mean(mx.square(update))) / self.d)
        return parameter - (alpha / denom).astype(parameter.dtype) * update
