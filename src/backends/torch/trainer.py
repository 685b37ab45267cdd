"""The torch trainer: one optimizer step over a list of micro-batches, normalised by the loss units of
the whole step (and of every rank in a distributed run), with SFT's token loss as the default objective."""

from __future__ import annotations

import contextlib

import torch

from ...errors import MudpuppyError
from ..protocol import StepResult
from ..stepping import StepLedger


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
        self.optimizer = build_optimizer(self.params, cfg, backend.plan, handle.model)
        # fp16 gradients underflow to zero without a loss scale; bf16 and fp32 need none.
        self.scaler = None
        if backend.plan.loss_scaling and handle.autocast_dtype == torch.float16:
            self.scaler = torch.amp.GradScaler(backend.plan.device.type)

    def step(self, micro_batches, lr: float, objective=None) -> StepResult:
        """One optimizer update over `micro_batches`, written out: forward and loss, backward, clipping, the
        optimizer. `objective` (protocol.Objective) replaces SFT's token loss. Running out of device memory
        raises one MudpuppyError naming what to change (memory.py)."""
        from .memory import explain_out_of_memory

        plan, engine = self.backend.plan, self.engine
        with explain_out_of_memory(plan.name, self.cfg, self.handle.adapter_type, plan.memory,
                                   gpu=plan.device.type != "cpu"):
            objective = objective or TokenLoss(self.backend)
            self.handle.model.train()
            self.optimizer.zero_grad(set_to_none=True)
            # The step's loss units, of every rank in a distributed run, normalise it (stepping.py says why).
            all_sum = (lambda values: engine.all_sum(values, plan.device)) if engine else None
            ledger = StepLedger(micro_batches, objective, engine.ranks if engine else None, all_sum)
            # Forward, loss and backward, micro-batch by micro-batch, the gradients adding up. DDP and FSDP
            # synchronise inside the backward pass: every rank runs the micro-batches that have loss units on
            # any rank, and the last one run synchronises the gradients.
            runs = ledger.run_by_all
            for i in runs:
                batch = micro_batches[i]
                with engine.micro_batch(sync=i == runs[-1]) if engine else contextlib.nullcontext(), \
                        self.backend.step_kernels(self.handle, batch, compiled=self.cfg.compile):
                    loss, metrics = self._forward(objective, batch)
                    scaled = loss * (ledger.scale * ledger.weight(i))
                    (self.scaler.scale(scaled) if self.scaler else scaled).backward()
                ledger.add(i, float(loss.detach()), metrics)
            ledger.finish()
            # Clipping, on the true gradient norm (an fp16 loss scale taken off first).
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            clip = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
            grad_norm = (engine.grad_norm(self.params, clip) if engine
                         else float(torch.nn.utils.clip_grad_norm_(self.params, clip)))
            if not ledger.finite(grad_norm):
                if self.scaler:
                    self.scaler.update()  # an fp16 overflow: lower the scale and try the next step
                self.optimizer.zero_grad(set_to_none=True)
                return ledger.result(grad_norm, skipped=True)
            # The optimizer's update, at the learning rate the loop's schedule gave.
            for group in self.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_ratio", 1.0)     # LoRA+'s B matrices: a multiple of it
            if self.scaler:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            return ledger.result(grad_norm)

    def _forward(self, objective, batch):
        """One micro-batch's summed loss and metrics, through the engine's forward when there is one."""
        def compute():
            with self.offload.saving() if self.offload else contextlib.nullcontext():
                return objective(self.handle, batch)

        return self.engine.forward(compute) if self.engine else compute()

    def release(self) -> None:
        """The optimizer state (AdamW's two moments, fp32 master weights with optimizer offload) and the last
        step's gradients go; the GPU's caching allocator hands the blocks they held back to the device."""
        from .memory import release_device_memory

        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.optimizer = None
        release_device_memory(self.backend.plan.device)

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
