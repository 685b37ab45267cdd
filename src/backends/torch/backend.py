"""The PyTorch implementation of the backend protocol, shared by cpu, cuda and rocm.

Nothing here branches on the device: `cpu.py`, `cuda.py` and `rocm.py` hand in
a `DevicePlan` (which torch device, which compute dtype, how to load) and this
class does the rest with transformers and PEFT.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import MudpuppyError
from ..models import resolve_model
from ..protocol import AdapterInfo, StepResult
from .attention import packed_attention_mask

IGNORE_INDEX = -100
# Tokens per lm_head chunk when computing the loss: bounds the [tokens x vocab]
# logits held at once (49k vocab x 1024 tokens x 4 bytes = 200 MB).
LOSS_CHUNK_TOKENS = 1024


@dataclass
class DevicePlan:
    """What differs per device, decided by cpu.py / cuda.py / rocm.py."""

    name: str                         # backend name: cpu, cuda, rocm
    device: torch.device
    autocast_dtype: torch.dtype | None = None   # compute dtype for matmuls, None = fp32
    notes: list[str] = field(default_factory=list)
    loss_scaling: bool = False        # scale fp16 losses (GradScaler) when the step computes in fp16
    env: dict[str, str] = field(default_factory=dict)   # variables a child process needs (see devices.py)
    attention: str = ""               # which SDPA kernel runs, for the report
    devices: list[int] = field(default_factory=list)    # torch indices of the GPUs in use
    precision: str = ""               # bf16, fp16, fp32 or fp8, as chosen by the device module
    fp8: bool = False                 # train linear layers with torchao's float8 recipe


@dataclass
class TorchModel:
    model: Any
    tokenizer: Any
    source: str
    autocast_dtype: torch.dtype | None = None


class TorchBackend:
    def __init__(self, plan: DevicePlan):
        self.plan = plan
        self.name = plan.name
        self.device = str(plan.device)

    # ------------------------------------------------------------------ models
    def load_model(self, model_cfg, precision: str = "auto") -> TorchModel:
        from transformers import AutoModelForCausalLM

        resolved = resolve_model(model_cfg.base_model, model_cfg.revision, model_cfg.trust_remote_code)
        tokenizer = self.load_tokenizer(model_cfg, resolved.path)
        dtype = {"auto": torch.float32, "float32": torch.float32,
                 "bfloat16": torch.bfloat16, "float16": torch.float16}[model_cfg.dtype]
        # Never device_map="auto": it segfaults on ROCm with an iGPU present.
        # Load on the CPU, then move the whole model to the planned device.
        model = AutoModelForCausalLM.from_pretrained(
            str(resolved.path), dtype=dtype, trust_remote_code=model_cfg.trust_remote_code,
            attn_implementation="sdpa",
        )
        model.to(self.plan.device)
        model.config.use_cache = False
        if self.plan.fp8:
            from .devices import convert_to_fp8

            convert_to_fp8(model)
        return TorchModel(model, tokenizer, str(resolved.path), self.compute_dtype(precision))

    def load_tokenizer(self, model_cfg, default_path: Path):
        from transformers import AutoTokenizer

        source = model_cfg.tokenizer or str(default_path)
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=model_cfg.trust_remote_code)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def compute_dtype(self, precision: str) -> torch.dtype | None:
        if precision == "fp32":
            return None
        if precision == "bf16":
            return torch.bfloat16
        if precision == "fp16":
            return torch.float16
        return self.plan.autocast_dtype

    def save_model(self, handle: TorchModel, path: str) -> None:
        handle.model.save_pretrained(path, safe_serialization=True)
        handle.tokenizer.save_pretrained(path)

    # ---------------------------------------------------------------- adapters
    def attach_adapter(self, handle: TorchModel, adapter_cfg) -> AdapterInfo:
        model = handle.model
        if adapter_cfg.type == "none":
            for p in model.parameters():
                p.requires_grad_(True)
            targets: list[str] = []
        else:
            from peft import LoraConfig, get_peft_model

            targets = self._target_modules(model, adapter_cfg.target_modules)
            config = LoraConfig(
                r=adapter_cfg.r, lora_alpha=adapter_cfg.alpha, lora_dropout=adapter_cfg.dropout,
                target_modules=targets, use_dora=adapter_cfg.type == "dora",
                use_rslora=adapter_cfg.rslora, task_type="CAUSAL_LM",
            )
            handle.model = model = get_peft_model(model, config)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        return AdapterInfo(adapter_cfg.type, trainable, total, targets)

    @staticmethod
    def _target_modules(model, wanted) -> list[str]:
        """Leaf names of the linear layers to adapt; the output head is never a target."""
        output = model.get_output_embeddings()
        linear = {name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
                  if isinstance(mod, torch.nn.Linear) and mod is not output}
        if wanted == "all-linear":
            if not linear:
                raise MudpuppyError("adapter.target_modules: this model has no linear layers to adapt")
            return sorted(linear)
        missing = [w for w in wanted if w not in linear]
        if missing:
            raise MudpuppyError(
                f"adapter.target_modules: {', '.join(missing)} match no linear layer in this model; "
                f"its linear layers are: {', '.join(sorted(linear))}"
            )
        return list(wanted)

    def save_adapter(self, handle: TorchModel, path: str) -> None:
        handle.model.save_pretrained(path, safe_serialization=True)

    def load_adapter(self, handle: TorchModel, path: str) -> None:
        from peft import PeftModel

        handle.model = PeftModel.from_pretrained(handle.model, path)
        handle.model.to(self.plan.device)

    def merge_and_save(self, handle: TorchModel, path: str, dtype: str = "bfloat16") -> None:
        """Fold the adapter into the base weights (in place) and save a plain transformers model.

        The handle holds the merged model afterwards; merging a model with no
        adapter left is a no-op, so merging twice gives the same weights.
        """
        from .merge import merge_adapter

        handle.model = merge_adapter(handle.model)
        handle.model.to(getattr(torch, dtype)).save_pretrained(path)
        handle.tokenizer.save_pretrained(path)

    # --------------------------------------------------------- training state
    def save_training_state(self, handle: TorchModel, trainer, path: str) -> None:
        from .state import save_training_state

        save_training_state(self, handle, trainer, path)

    def load_training_state(self, handle: TorchModel, trainer, path: str) -> None:
        from .state import load_training_state

        load_training_state(self, handle, trainer, path)

    # ----------------------------------------------------------------- compute
    def seed(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def create_trainer(self, handle: TorchModel, training_cfg) -> "TorchTrainer":
        if training_cfg.gradient_checkpointing:
            base = _unwrap(handle.model)
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return TorchTrainer(self, handle, training_cfg)

    def _tensors(self, batch, model) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Model keyword inputs and the labels. A packed batch gets its per-segment
        positions and a block-diagonal causal mask (see attention.py)."""
        dev = self.plan.device
        inputs = {"input_ids": torch.as_tensor(batch.input_ids, device=dev)}
        labels = torch.as_tensor(batch.labels, device=dev)
        if getattr(batch, "segment_ids", None) is None:
            inputs["attention_mask"] = torch.as_tensor(batch.attention_mask, device=dev)
            return inputs, labels
        base = _unwrap(model)
        impl = getattr(base.config, "_attn_implementation", None) or "eager"
        segments = torch.as_tensor(batch.segment_ids, device=dev)
        inputs["attention_mask"] = packed_attention_mask(segments, impl, base.dtype)
        inputs["position_ids"] = torch.as_tensor(batch.position_ids, device=dev)
        return inputs, labels

    def _autocast(self, handle: TorchModel):
        if handle.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.plan.device.type, dtype=handle.autocast_dtype)

    def loss_sum(self, handle: TorchModel, batch) -> tuple[torch.Tensor, int]:
        """Summed cross-entropy over loss-carrying tokens, without full-vocab logits for the rest.

        Only positions with a target go through the output head, in chunks, so
        a chat example whose answer is 5 tokens costs 5 rows of logits, not T.
        """
        inputs, labels = self._tensors(batch, handle.model)
        base = _unwrap(handle.model)
        with self._autocast(handle):
            hidden = base.get_decoder()(**inputs).last_hidden_state
            keep = labels != IGNORE_INDEX
            hidden, targets = hidden[keep], labels[keep]
            head = base.get_output_embeddings()
            total = hidden.new_zeros((), dtype=torch.float32)
            for start in range(0, targets.numel(), LOSS_CHUNK_TOKENS):
                logits = head(hidden[start : start + LOSS_CHUNK_TOKENS]).float()
                total = total + torch.nn.functional.cross_entropy(
                    logits, targets[start : start + LOSS_CHUNK_TOKENS], reduction="sum")
        return total, int(targets.numel())

    @torch.no_grad()
    def evaluate_loss(self, handle: TorchModel, batches) -> tuple[float, int]:
        handle.model.eval()
        total, count = 0.0, 0
        for batch in batches:
            loss, n = self.loss_sum(handle, batch)
            total += float(loss)
            count += n
        return total, count

    @torch.no_grad()
    def logits(self, handle: TorchModel, batch) -> np.ndarray:
        handle.model.eval()
        inputs, _ = self._tensors(batch, handle.model)
        with self._autocast(handle):
            out = handle.model(**inputs).logits
        return out.float().cpu().numpy()

    @torch.no_grad()
    def generate(self, handle: TorchModel, prompts: list[list[int]], max_new_tokens: int,
                 stop_ids: list[int]) -> list[list[int]]:
        """Greedy decoding, prompts left-padded into one batch."""
        handle.model.eval()
        pad = handle.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            attn[row, width - len(p):] = 1
        with self._autocast(handle):
            out = handle.model.generate(
                input_ids=ids.to(self.plan.device), attention_mask=attn.to(self.plan.device),
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop_ids,
                pad_token_id=pad, use_cache=True,
            )
        results = []
        for row in out[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in stop_ids), len(row))
            results.append(row[:cut])
        return results


class TorchTrainer:
    """One optimizer over the trainable parameters; the pipeline passes the learning rate in."""

    def __init__(self, backend: TorchBackend, handle: TorchModel, cfg):
        self.backend, self.handle, self.cfg = backend, handle, cfg
        self.params = [p for p in handle.model.parameters() if p.requires_grad]
        if not self.params:
            raise MudpuppyError("nothing to train: the model has no trainable parameters")
        decay = cfg.weight_decay
        if cfg.optimizer == "adamw":
            self.optimizer = torch.optim.AdamW(
                self.params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                weight_decay=decay, foreach=True)
        elif cfg.optimizer == "adafactor":
            # Factored second moments: optimizer memory ~ rows + cols instead of rows x cols.
            self.optimizer = torch.optim.Adafactor(self.params, lr=cfg.learning_rate, weight_decay=decay)
        else:
            self.optimizer = torch.optim.SGD(self.params, lr=cfg.learning_rate, momentum=cfg.momentum,
                                             weight_decay=decay)
        # fp16 gradients underflow to zero without a loss scale; bf16 and fp32 need none.
        self.scaler = None
        if backend.plan.loss_scaling and handle.autocast_dtype == torch.float16:
            self.scaler = torch.amp.GradScaler(backend.plan.device.type)

    def step(self, micro_batches, lr: float) -> StepResult:
        model = self.handle.model
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # Normalise by the loss tokens of the whole step, so accumulation over
        # micro-batches gives exactly the gradient of one large batch.
        loss_tokens = sum(b.loss_tokens for b in micro_batches)
        total = 0.0
        for batch in micro_batches:
            loss, _ = self.backend.loss_sum(self.handle, batch)
            scaled = loss / max(loss_tokens, 1)
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            total += float(loss.detach())
        tokens = sum(b.real_tokens for b in micro_batches)
        mean = total / max(loss_tokens, 1)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # clip and report the true gradient norm
        clip = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        if not (np.isfinite(mean) and np.isfinite(grad_norm)):
            if self.scaler:
                self.scaler.update()  # an fp16 overflow: lower the scale and try the next step
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(mean, loss_tokens, tokens, grad_norm, skipped=True)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        return StepResult(mean, loss_tokens, tokens, grad_norm)

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state()}
        if self.backend.plan.device.type == "cuda":   # dropout on the GPU draws from its own generator
            state["cuda_rng"] = torch.cuda.get_rng_state(self.backend.plan.device)
        if self.scaler:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], self.backend.plan.device)
        if self.scaler and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])


def _unwrap(model):
    """The transformers model under a PEFT wrapper (LoRA layers stay injected in it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
