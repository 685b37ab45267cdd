"""The torch backend's leaf types: what a device module plans (DevicePlan) and what the pipelines hold
(TorchModel), with the constants every torch compute path shares. It imports nothing of the backend,
so the device, distributed and state modules can use these without importing the facade."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

IGNORE_INDEX = -100
# Scalar-head models: the transformers Auto class, the classes per position, PEFT's task type
# (which also makes PEFT train and save the new head in full: modules_to_save).
HEADS = {
    "sequence_classification": ("AutoModelForSequenceClassification", 1, "SEQ_CLS"),
    "token_classification": ("AutoModelForTokenClassification", 2, "TOKEN_CLS"),
}
# Module names of the new scalar heads: read from no checkpoint, trained in full.
SCALAR_HEADS = ("score", "classifier")
# Tokens per lm_head chunk when computing the loss: bounds the [tokens x vocab]
# logits held at once (49k vocab x 1024 tokens x 4 bytes = 200 MB).
LOSS_CHUNK_TOKENS = 1024


@dataclass
class DevicePlan:
    """What differs per device, decided by devices/cpu.py, cuda.py, rocm.py."""

    name: str                         # backend name: cpu, cuda, rocm
    device: torch.device
    autocast_dtype: torch.dtype | None = None   # compute dtype for matmuls, None = fp32
    notes: list[str] = field(default_factory=list)
    loss_scaling: bool = False        # scale fp16 losses (GradScaler) when the step computes in fp16
    env: dict[str, str] = field(default_factory=dict)   # variables a child process needs (see devices/gpu.py)
    attention: str = ""               # which SDPA kernel runs, for the report
    devices: list[int] = field(default_factory=list)    # torch indices of the GPUs in use
    precision: str = ""               # bf16, fp16, fp32 or fp8, as chosen by the device module
    fp8: bool = False                 # train linear layers with torchao's float8 recipe
    memory: Any = None                # config.MemoryConfig: offload and streaming (None: all off)
    optimizer: str = "adamw"          # training.optimizer, checked against this device when the plan is made
    host: torch.device = field(default_factory=lambda: torch.device("cpu"))   # where offloaded state lives
    distributed: Any = None           # config.DistributedConfig: the strategy when launched as several processes
    deterministic: bool = False       # training.deterministic: torch's deterministic algorithms (devices/gpu.py)


@dataclass
class TorchModel:
    model: Any
    tokenizer: Any
    source: str
    autocast_dtype: torch.dtype | None = None
    head: str | None = None           # None (causal LM) or a key of HEADS
    load_report: Any = None           # loading.LoadReport: how and at which dtype the weights were read
    adapter_type: str | None = None   # set by attach_adapter: none, lora, dora or qlora
    processor: Any = None             # vision-language models: their AutoProcessor (model/vision.py); None for text
    freeze_vision: bool = True        # model.freeze_vision, applied by attach_adapter
    plain_lora: tuple | None = None   # (model, its lora.plain_lora_layers), cached by _autocast

    def describe(self) -> str:
        return self.load_report.describe() if self.load_report is not None else "loaded"


def unwrap(model):
    """The transformers model under a PEFT wrapper (LoRA layers stay injected in it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextlib.contextmanager
def attribute_set(objects: list, name: str, value):
    """Within: `name` is `value` on each of `objects`; afterwards what each had (True where unset)."""
    before = [getattr(obj, name, True) for obj in objects]
    for obj in objects:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, old in zip(objects, before):
            setattr(obj, name, old)


def cache_on(model):
    """`use_cache: true` in the config.json a saved model carries (training loads it off): the model
    someone loads from it generates with a KV cache."""
    configs = [c for c in (model.config, getattr(model.config, "text_config", None)) if c is not None]
    return attribute_set(configs, "use_cache", True)


def gathered(method):
    """Under FSDP, compute outside a training step sees the root's parameters whole (distributed.py)."""
    @functools.wraps(method)
    def wrapper(self, handle, *args, **kwargs):
        engine = self.engine
        if engine is None or handle.model is not engine.step_module.model:
            return method(self, handle, *args, **kwargs)
        with engine.gathered():
            return method(self, handle, *args, **kwargs)

    return wrapper
