"""The torch trainer: one optimizer step over a list of micro-batches, normalised by the loss units of
the whole step (and of every rank in a distributed run), with SFT's token loss as the default objective."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ...distributed import is_placeholder, sum_step, whole
from ...errors import MudpuppyError
from ..protocol import StepResult


class TorchTrainer:
    """One optimizer over the trainable parameters; the pipeline passes the learning rate in.

    With an `engine` (distributed.py) this process is one rank of several: each micro-batch
    runs through the engine, and the step is normalised by the loss units of all ranks."""

    def __init__(self, backend, handle, cfg, offload=None, engine=None):
        from .optimizers import build_optimizer

        self.backend, self.handle, self.cfg = backend, handle, cfg
        self.offload = offload          # memory.ActivationOffload, or None
        self.engine = engine
        self.params = [p for p in handle.model.parameters() if p.requires_grad]
        if not self.params:
            raise MudpuppyError("nothing to train: the model has no trainable parameters")
        if engine is not None and (cfg.optimizer != "adamw" and cfg.optimizer not in ("sgd", "adafactor")):
            raise MudpuppyError(f"training.optimizer: {cfg.optimizer} keeps state torch.distributed.checkpoint "
                                "cannot shard; distributed runs use adamw, sgd or adafactor")
        self.optimizer = build_optimizer(self.params, cfg, backend.plan)
        # fp16 gradients underflow to zero without a loss scale; bf16 and fp32 need none.
        self.scaler = None
        if backend.plan.loss_scaling and handle.autocast_dtype == torch.float16:
            self.scaler = torch.amp.GradScaler(backend.plan.device.type)

    def step(self, micro_batches, lr: float, objective=None) -> StepResult:
        """One update; `objective` (see protocol.Objective) replaces the SFT token loss.

        Running out of device memory raises one MudpuppyError naming what to change (memory.py)."""
        from .memory import explain_out_of_memory

        plan = self.backend.plan
        with explain_out_of_memory(plan.name, self.cfg, self.handle.adapter_type, plan.memory,
                                   gpu=plan.device.type != "cpu"):
            return self._step(micro_batches, lr, objective)

    def _step(self, micro_batches, lr: float, objective=None) -> StepResult:
        objective = objective or TokenLoss(self.backend)
        model = self.handle.model
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        engine, device = self.engine, self.backend.plan.device
        # Normalise by the count (loss tokens for SFT) of the whole step, so accumulation
        # over micro-batches gives exactly the gradient of one large batch; in a distributed
        # run the count of every rank's share, so N ranks give the gradient of one process.
        counts = [0 if is_placeholder(b) else objective.count(b) for b in micro_batches]
        step_counts = [whole(c) for c in engine.all_sum(counts, device)] if engine else counts
        loss_tokens = sum(step_counts)          # may be fractional (GRPO weighs sequences)
        # Each engine averages gradients over the ranks; the sum over ranks is what one process computes.
        scale = (engine.ranks.world if engine else 1) / max(loss_tokens, 1)
        # A micro-batch with no loss units anywhere is skipped by every rank alike; the last one run
        # synchronises the gradients.
        runs = [i for i, n in enumerate(step_counts) if n > 0]
        total, sums, weights = 0.0, {}, {}
        for i in runs:
            batch, n = micro_batches[i], counts[i]
            # A placeholder (a rank left without data at the end of an epoch) runs with weight zero.
            weight = 0.0 if is_placeholder(batch) else 1.0
            with engine.micro_batch(sync=i == runs[-1]) if engine else contextlib.nullcontext(), \
                    self.backend.step_kernels(self.handle, batch, compiled=self.cfg.compile):
                loss, metrics = self._forward(objective, batch)
                scaled = loss * (scale * weight)
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            total += float(loss.detach()) * weight
            for key, value in (metrics.items() if weight else ()):   # a metric may be absent from some micro-batches
                sums[key] = sums.get(key, 0.0) + value * n
                weights[key] = weights.get(key, 0) + n
        tokens = sum(getattr(b, "real_tokens", 0) for b in micro_batches if not is_placeholder(b))
        if engine:
            total, tokens, sums, weights = sum_step(engine.ranks, lambda v: engine.all_sum(v, device),
                                                    total, tokens, sums, weights)
        metrics = {key: value / weights[key] for key, value in sums.items() if weights[key]}
        mean = total / max(loss_tokens, 1)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # clip and report the true gradient norm
        clip = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
        grad_norm = (engine.grad_norm(self.params, clip) if engine
                     else float(torch.nn.utils.clip_grad_norm_(self.params, clip)))
        if not (np.isfinite(mean) and np.isfinite(grad_norm)):
            if self.scaler:
                self.scaler.update()  # an fp16 overflow: lower the scale and try the next step
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(mean, loss_tokens, tokens, grad_norm, skipped=True, metrics=metrics)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        return StepResult(mean, loss_tokens, tokens, grad_norm, metrics=metrics)

    def _forward(self, objective, batch):
        """One micro-batch's summed loss and metrics, through the engine's forward when there is one."""
        def compute():
            with self.offload.saving() if self.offload else contextlib.nullcontext():
                return objective(self.handle, batch)

        return self.engine.forward(compute) if self.engine else compute()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), **self.runtime_state()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_runtime_state(state)

    def runtime_state(self) -> dict:
        """What a checkpoint keeps besides weights and optimizer: RNG streams and the loss scale."""
        state = {"torch_rng": torch.get_rng_state()}
        if self.backend.plan.device.type == "cuda":   # dropout on the GPU draws from its own generator
            state["cuda_rng"] = torch.cuda.get_rng_state(self.backend.plan.device)
        if self.scaler:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_runtime_state(self, state: dict) -> None:
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], self.backend.plan.device)
        if self.scaler and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])


class TokenLoss:
    """SFT's objective: summed cross-entropy over label != -100 tokens, averaged per token."""

    def __init__(self, backend):
        self.backend = backend

    def count(self, batch) -> int:
        return batch.loss_tokens

    def __call__(self, handle, batch):
        loss, _ = self.backend.loss_sum(handle, batch)
        return loss, {}
