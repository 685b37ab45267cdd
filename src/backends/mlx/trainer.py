"""One optimizer step on MLX, with the torch backend's semantics to the letter.

- loss: summed token cross-entropy divided by the loss tokens of the whole
  step, so accumulating micro-batches gives the gradient of one large batch;
- clipping: torch's `clip_grad_norm_` (global L2 norm, coefficient
  max_norm / (norm + 1e-6), never above 1);
- a non-finite loss or gradient norm skips the update;
- AdamW, SGD or Adafactor with torch's update rules (see optimizers.py).

State is explicit, as in mlx-lm's trainer: trainable parameters (saved as
the adapter), optimizer state (numpy arrays in `state_dict`) and the RNG,
which is reseeded from (seed, step) before every step, so dropout masks
after a resume are the ones an uninterrupted run would draw.

By default the step runs eagerly: every batch has its own length and number
of loss tokens, and a compiled function is traced again for each new shape.
`training.compile: true` compiles SFT's loss and gradient with the shapes
put in buckets, so a run traces a handful of times (compiled.py says how,
and why other objectives are refused).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ...errors import MudpuppyError
from ..protocol import StepResult
from ..stepping import StepLedger
from .compiled import CompiledTokenLoss
from .forward import loss_sum
from .optimizers import build_optimizer


def global_norm(grads) -> mx.array:
    return mx.sqrt(sum((g.astype(mx.float32) ** 2).sum() for _, g in tree_flatten(grads)))


def clip_by_norm(grads, norm: float, max_norm: float | None):
    if max_norm is None:
        return grads
    coef = min(max_norm / (norm + 1e-6), 1.0)
    return tree_map(lambda g: g * coef, grads)


class MlxTrainer:
    """One optimizer over the trainable parameters; the pipeline passes the learning rate in.

    In a distributed run (`ranks.distributed`) each rank computes the gradient of its share and the
    gradients are averaged once per step (distributed.py)."""

    def __init__(self, handle, cfg, ranks=None):
        from ...distributed import Ranks

        self.handle, self.cfg = handle, cfg
        self.ranks = ranks or Ranks()
        if not tree_flatten(handle.model.trainable_parameters()):
            raise MudpuppyError("nothing to train: the model has no trainable parameters")
        if cfg.gradient_checkpointing:
            raise MudpuppyError("training.gradient_checkpointing is not available on the MLX backend yet; "
                                "set it to false (MLX keeps activations; lower micro_batch_size instead)")
        self.optimizer = build_optimizer(cfg)
        self.seed = cfg.seed
        self.steps = 0
        self.value_and_grad = nn.value_and_grad(handle.model, self._loss)
        if getattr(cfg, "compile", False) and handle.router_aux_coef:
            raise MudpuppyError("training.compile on the mlx backend does not cover the router load-balancing "
                                "loss this model adds; set training.compile: false, or model.router_aux_loss_coef: 0")
        self.compiled = CompiledTokenLoss(handle) if getattr(cfg, "compile", False) else None
        self._metrics: dict[str, float] = {}

    def _loss(self, model, objective, batch, scale):
        loss, self._metrics = objective(self.handle, batch)
        return loss * scale, loss

    def step(self, micro_batches, lr: float, objective=None) -> StepResult:
        """One optimizer update over `micro_batches`, written out: forward, loss and backward, clipping, the
        optimizer. `objective` (protocol.Objective) replaces SFT's token loss."""
        objective = objective or TokenLoss()
        model = self.handle.model
        model.train()
        mx.random.seed(self._step_seed())
        self.steps += 1
        all_sum = None
        if self.ranks.distributed:
            from .distributed import all_sum
        # The step's loss units, of every rank in a distributed run, normalise it (stepping.py says why).
        ledger = StepLedger(micro_batches, objective, self.ranks, all_sum)
        grads = None
        # Forward, loss and backward (mlx's value_and_grad) micro-batch by micro-batch, the gradients adding up.
        # They are averaged over ranks once per step, below: a micro-batch without loss units here is not run.
        for i in ledger.run_here:
            (_, raw), g = self._value_and_grad(objective, micro_batches[i], ledger.scale)
            grads = g if grads is None else tree_map(mx.add, grads, g)
            mx.eval(raw, grads)
            ledger.add(i, raw.item(), self._metrics)
        ledger.finish()
        if all_sum and ledger.units:
            from .distributed import average_gradients

            # Every rank takes part in the average, one without loss units this step with zeros.
            if grads is None:
                grads = tree_map(mx.zeros_like, model.trainable_parameters())
            grads = average_gradients(grads)
            mx.eval(grads)
        if grads is None or not ledger.units:
            return ledger.result(0.0, skipped=True)
        # Clipping, as torch's clip_grad_norm_ does it; a non-finite loss or norm skips the update.
        grad_norm = global_norm(grads).item()
        if not ledger.finite(grad_norm):
            return ledger.result(grad_norm, skipped=True)
        grads = clip_by_norm(grads, grad_norm, self.cfg.max_grad_norm)
        # The optimizer's update, at the learning rate the loop's schedule gave.
        self.optimizer.learning_rate = lr
        self.optimizer.update(model, grads)
        mx.eval(model.trainable_parameters(), self.optimizer.state)
        return ledger.result(grad_norm)

    def _value_and_grad(self, objective, batch, scale: float):
        """((loss * scale, loss), gradients) of one micro-batch: compiled for SFT when asked, else eager."""
        if self.compiled is None:
            return self.value_and_grad(self.handle.model, objective, batch, scale)
        if not isinstance(objective, TokenLoss):
            raise MudpuppyError(
                f"training.compile: on the mlx backend mx.compile covers SFT's token loss; this method's "
                f"objective ({type(objective).__name__}) is computed from each batch in Python and cannot be "
                "compiled; set training.compile: false")
        self._metrics = {}
        return self.compiled(batch, scale)

    def _step_seed(self) -> int:
        return (self.seed * 1_000_003 + self.steps) % 2**63

    def release(self) -> None:
        """The optimizer state goes and MLX's buffer cache is emptied, for what follows training."""
        self.optimizer = None
        mx.clear_cache()

    def state_dict(self) -> dict:
        """Optimizer state as numpy arrays (bf16 widened to float32, exactly, with its dtype noted)."""
        arrays, dtypes = {}, {}
        for key, value in tree_flatten(self.optimizer.state):
            if value.dtype == mx.bfloat16:
                dtypes[key] = "bfloat16"
                value = value.astype(mx.float32)
            arrays[key] = np.array(value)
        return {"optimizer": arrays, "optimizer_dtypes": dtypes, "rng": {"seed": self.seed, "steps": self.steps}}

    def load_state_dict(self, state: dict) -> None:
        narrow = state.get("optimizer_dtypes", {})
        arrays = [(k, mx.array(v).astype(mx.bfloat16) if k in narrow else mx.array(v))
                  for k, v in state["optimizer"].items()]
        self.optimizer.state = tree_unflatten(arrays)
        self.seed, self.steps = int(state["rng"]["seed"]), int(state["rng"]["steps"])


class TokenLoss:
    """SFT's objective: summed cross-entropy over label != -100 tokens, averaged per token."""

    def count(self, batch) -> int:
        return batch.loss_tokens

    def __call__(self, handle, batch):
        return loss_sum(handle, batch, router_aux=True), {}
