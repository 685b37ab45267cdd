"""The PyTorch implementation of the backend protocol, shared by cpu, cuda and rocm.

Nothing here branches on the device: `devices/cpu.py`, `cuda.py` and `rocm.py` hand in
a `DevicePlan` (which torch device, which compute dtype, how to load) and this
class does the rest with transformers and PEFT.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import numpy as np
import torch

from ...config.run import fp8_problem
from ...data.tokenizers import load_text_tokenizer, save_tokenizer
from ...errors import MudpuppyError
from ...noise import import_noise_dropped
from ..adapters import record_base
from ..models import resolve_model
from ..provenance import base_record_of_path
from ..protocol import AdapterInfo
from ..routing import read_router_aux_coefficient
from .handle import HEADS, SCALAR_HEADS, DevicePlan, TorchModel, cache_on, unwrap
from .model.attach import attach_adapter
from .model.lora_init import save_plain
from .trainer import TorchTrainer
from .devices.fp8_training import convert_to_fp8
from .forward import TorchForward
from .model.loading import compact_dtype, load_model_weights, quiet_if, storage_dtype
from .model.frozen import compute_compact_embeddings
from .quantization.gptq.method import TorchGptq
from .quantization.imatrix import collect_input_squares
from .memory import return_freed_host_memory
from .ops import TorchOps
from .quantization.qat.method import TorchQat
from .quantization.qat.files import is_qat_checkpoint
from .model.vision import is_vision_checkpoint


class TorchBackend(TorchForward):
    adapter_layouts, transformers_model = ("peft",), True      # what this runtime can do (protocol.py)

    def __init__(self, plan: DevicePlan):
        from .distributed import join

        self.plan = plan
        self.name = plan.name
        self.device = str(plan.device)
        self.ops = TorchOps(plan.device)
        self.ranks = join(plan.device.type, plan.distributed)   # rank 0 of 1 unless a launcher started several
        self.engine = None            # distributed.Engine once a trainer wraps the model for several processes
        if self.ranks.distributed:
            plan.notes.append(f"distributed: rank {self.ranks.rank} of {self.ranks.world}, strategy "
                              f"{plan.distributed.strategy if plan.distributed else 'ddp'}")

    # ------------------------------------------------------------------ models
    def load_model(self, model_cfg, precision: str = "auto", head: str | None = None, adapter=None) -> TorchModel:
        """The model at its storage precision on the device (model/loading.py); with `adapter` (an AdapterConfig)
        the storage follows what trains: fp32 for full fine-tuning, the compute dtype for a frozen base,
        4-bit codes quantized while loading for QLoRA."""
        if head is not None and head not in HEADS:
            raise MudpuppyError(f"unknown model head {head!r}; known: {', '.join(HEADS)}")
        auto_class, num_labels, _ = HEADS[head] if head else ("AutoModelForCausalLM", None, None)
        head_kwargs = {"num_labels": num_labels} if head else {}
        resolved = resolve_model(model_cfg.base_model, model_cfg.revision, model_cfg.trust_remote_code)
        if adapter is not None and is_qat_checkpoint(resolved.path):
            raise MudpuppyError(
                f"model.base_model {model_cfg.base_model!r} is a converted QAT model: integer weights for "
                "inference (eval, chat, serve, export), which no adapter or optimizer can train. Train on its "
                "float fine-tune (the QAT run's trained/ directory) or on `mudpuppy export --format merged` of it")
        # Refused before any weight loads where the model has no router.
        override = getattr(model_cfg, "router_aux_loss_coef", None)
        aux_coef = read_router_aux_coefficient(resolved.path, override)
        vision = head is None and is_vision_checkpoint(model_cfg, resolved.path)
        if vision:
            from ...data.vision import load_vision_tokenizer

            if adapter is not None and adapter.type == "qlora":
                raise MudpuppyError("adapter.type: qlora is not available for vision-language models; use lora, "
                                    "dora or none")
            auto_class = "AutoModelForImageTextToText"
            tokenizer = load_vision_tokenizer(model_cfg.tokenizer or str(resolved.path), model_cfg.trust_remote_code)
        else:
            tokenizer = self.load_tokenizer(model_cfg, resolved.path)
        compute = self.compute_dtype(precision)
        kind = adapter.type if adapter is not None else None
        stream = bool(self.plan.memory and self.plan.memory.stream_layers and adapter is not None)
        if self.plan.fp8 and fp8_problem(kind, stream):
            raise MudpuppyError(fp8_problem(kind, stream))
        dtype = storage_dtype(model_cfg.dtype, compute, trains_in_full=kind == "none")
        # A frozen base computed in fp32 (no native 16-bit matmuls) stays in its 16-bit checkpoint dtype.
        compact = compact_dtype(resolved.path) if (model_cfg.dtype == "auto" and kind not in (None, "none")
                                                   and dtype == torch.float32) else None
        return_freed_host_memory()    # a model loaded tensor by tensor would otherwise leave the heap at its peak
        # A new head's "missing weights" report is expected, not news; torchao's import lines are noise (noise.py).
        with quiet_if(head is not None), import_noise_dropped():
            model, report = load_model_weights(
                auto_class, resolved.path, dtype, self.plan.device, self._frozen_planner(adapter, dtype, compact),
                model_cfg.trust_remote_code, head_kwargs, new_modules=SCALAR_HEADS if head else ())
        model.config.use_cache = False
        if vision and hasattr(model.config, "text_config"):
            model.config.text_config.use_cache = False
        if compact:
            compute_compact_embeddings(model, dtype)
        if override is not None:
            from .model.experts import set_router_aux_loss

            set_router_aux_loss(model, aux_coef)
        if head:
            # A sequence score is read at the last token that is not padding; the model finds it by this id.
            model.config.pad_token_id = tokenizer.pad_token_id
        if self.plan.fp8:
            convert_to_fp8(model)
        return TorchModel(model, tokenizer, str(resolved.path), compute, head, report,
                          processor=tokenizer.processor if vision else None,
                          freeze_vision=getattr(model_cfg, "freeze_vision", True))

    def _frozen_planner(self, adapter, dtype: torch.dtype, compact: torch.dtype | None):
        """Which linear layers of the base become frozen layers while loading (model/frozen.py), and how:
        4-bit (QLoRA), in host memory (memory.stream_layers), or stored in `compact` (a 16-bit
        checkpoint dtype the device does not compute in) and upcast per use."""
        from .model.experts import find_moe, packed_parameter
        from .model.frozen import StoredLinear
        from .model.loading import FrozenPlan
        from .quantization.linear4bit import Linear4bit, find_quantizable_linears

        quantize = adapter is not None and adapter.type == "qlora"
        stream = bool(self.plan.memory and self.plan.memory.stream_layers) and adapter is not None
        device, host = self.plan.device, self.plan.host
        stored_dtype = compact or dtype

        def build(name, weight, bias):
            if quantize:
                # Quantized on the device from the checkpoint's own values, so a merge that loads again
                # rebuilds exactly this base.
                layer = Linear4bit.from_weight(weight.to(device), bias, adapter.quant_backend,
                                               adapter.quant_group_size, stream_to=device if stream else None)
                layer.weight_dtype = dtype
                return layer
            layer = StoredLinear.from_weight(weight.to(stored_dtype), bias, device, host if stream else None)
            layer.weight_dtype = dtype
            return layer

        def build_experts(key, weight):
            return packed_parameter(weight, adapter.quant_backend, adapter.quant_group_size)

        def plan(model) -> FrozenPlan:
            if not (quantize or stream or compact):
                return FrozenPlan()
            # Output and scalar heads stay as they are: a reward model's new head trains in full.
            names = set(find_quantizable_linears(model, ("lm_head", *SCALAR_HEADS)))
            embedding = model.get_input_embeddings()
            keys = {f"{name}.weight" for name, m in model.named_modules() if m is embedding} if compact else set()
            # QLoRA: a mixture-of-experts model's fused expert stacks (most of its weights) are 4-bit too.
            experts = set(find_moe(model).parameter_keys()) if quantize else set()
            return FrozenPlan(names, build, keys, compact, params=experts, build_param=build_experts)

        return plan

    def load_tokenizer(self, model_cfg, default_path: Path):
        return load_text_tokenizer(model_cfg, default_path)

    def compute_dtype(self, precision: str) -> torch.dtype | None:
        if precision == "fp32":
            return None
        if precision == "bf16":
            return torch.bfloat16
        if precision == "fp16":
            return torch.float16
        return self.plan.autocast_dtype

    def save_model(self, handle: TorchModel, path: str) -> None:
        """The whole model; in a distributed run gathered to rank 0, which alone writes."""
        state = self._gather_state(handle, trainable_only=False)
        if self.ranks.is_main:
            with cache_on(handle.model):
                handle.model.save_pretrained(path, safe_serialization=True, **state)
            save_tokenizer(handle.tokenizer, path)

    def _gather_state(self, handle: TorchModel, trainable_only: bool) -> dict:
        """{} for one process; else {"state_dict": the full state on rank 0} (collective under FSDP)."""
        if self.engine is None or handle.model is not self.engine.step_module.model:
            return {}
        from .distributed import full_state_dict

        return {"state_dict": full_state_dict(handle.model, trainable_only)}

    # ---------------------------------------------------------------- adapters
    def attach_adapter(self, handle: TorchModel, adapter_cfg, batches=None) -> AdapterInfo:
        """PEFT's adapter (LoRA, DoRA, QLoRA's on the 4-bit base), or every weight trainable (model/attach.py);
        adapter.init eva decomposes the inputs of `batches` (model/eva.py); loftq sets A, B from each 4-bit
        weight's quantization error (model/loftq.py)."""
        if getattr(adapter_cfg, "init", "default") == "eva":
            from .model.eva import attach_eva

            return attach_eva(self, handle, adapter_cfg, batches)
        if getattr(adapter_cfg, "init", "default") == "loftq":
            from .model.loftq import attach_loftq

            return attach_loftq(self, handle, adapter_cfg)
        return attach_adapter(self, handle, adapter_cfg)

    def quantize_base(self, handle: TorchModel, adapter_cfg) -> str:
        """Replace the base model's linear layers by our 4-bit ones (QLoRA); returns a one-line report.
        Deterministic, so a resumed run quantizes again and gets the same base."""
        from .model.experts import quantize_experts, summarize_experts
        from .quantization.linear4bit import quantize_model, summarize_quantized

        loaded = summarize_quantized(handle.model)
        if loaded is not None:          # quantized while loading (load_model with a qlora adapter)
            experts = summarize_experts(handle.model)
            return loaded.summary() + (f"; {experts.summary()}" if experts.tensors else "") + ", while loading"
        # Output and scalar heads stay full precision: a reward model's new head trains in full.
        report = quantize_model(handle.model, adapter_cfg.quant_backend, adapter_cfg.quant_group_size,
                                skip_modules=("lm_head", *SCALAR_HEADS))
        experts = quantize_experts(handle.model, adapter_cfg.quant_backend, adapter_cfg.quant_group_size)
        return report.summary() + (f"; {experts.summary()}" if experts.tensors else "")

    def save_adapter(self, handle: TorchModel, path: str) -> None:
        """The PEFT adapter; in a distributed run the same file a single process writes, from rank 0. Its
        config names the base portably, mudpuppy's exact record beside it (adapters.record_base)."""
        state = self._gather_state(handle, trainable_only=True)
        if self.ranks.is_main:
            handle.model.save_pretrained(path, safe_serialization=True, **state)
            save_plain(handle.model, path)          # PiSSA / OLoRA: a plain LoRA on the original base
            record_base(path, base_record_of_path(handle.source))

    def load_adapter(self, handle: TorchModel, path: str) -> None:
        from peft import PeftConfig, PeftModel

        from .model.frozen import weight_reads_without_values

        dora = getattr(PeftConfig.from_pretrained(path), "use_dora", False)
        with weight_reads_without_values() if not dora else contextlib.nullcontext():
            handle.model = PeftModel.from_pretrained(handle.model, path)
        handle.model.to(self.plan.device)

    def merge_and_save(self, handle: TorchModel, path: str, dtype: str = "bfloat16") -> None:
        """Fold the adapter into the base weights (in place) and save a plain transformers model. The
        handle holds the merged model afterwards; merging a model with no adapter left is a no-op, so
        merging twice gives the same weights."""
        from .model.merge import merge_adapter

        handle.model = merge_adapter(handle.model)
        with cache_on(handle.model):
            handle.model.to(getattr(torch, dtype)).save_pretrained(path)
        save_tokenizer(handle.tokenizer, path)

    # --------------------------------------------------------- training state
    def save_training_state(self, handle: TorchModel, trainer, path: str) -> None:
        from .state import save_training_state

        save_training_state(self, handle, trainer, path)

    def load_training_state(self, handle: TorchModel, trainer, path: str) -> None:
        from .state import load_training_state

        load_training_state(self, handle, trainer, path)

    # ------------------------------------------------ quantization recipes (quantization/gptq, quantization/qat)
    def plan_gptq(self, gptq_cfg) -> TorchGptq:
        return TorchGptq(gptq_cfg, self.device)

    def plan_qat(self, qat_cfg) -> TorchQat:
        return TorchQat(qat_cfg)

    # ----------------------------------------------------------------- compute
    def host_backend(self) -> "TorchBackend":
        if self.plan.device.type == "cpu":
            return self
        # fp32 compute: what needs the host (a merge) loads its weights in fp32 anyway.
        return TorchBackend(DevicePlan("cpu", torch.device("cpu"), None, precision="fp32",
                                       notes=["host memory, beside a run on the GPU"]))

    def input_squares(self, handle: TorchModel, sequences: list[list[int]]) -> dict[str, tuple[np.ndarray, int]]:
        return collect_input_squares(unwrap(handle.model), sequences)

    def memory_peaks(self) -> dict[str, int] | None:
        device = self.plan.device
        if device.type != "cuda":
            return None
        peaks = {"allocated": torch.cuda.max_memory_allocated(device),
                 "reserved": torch.cuda.max_memory_reserved(device)}
        torch.cuda.reset_peak_memory_stats(device)
        return peaks

    def seed(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def create_trainer(self, handle: TorchModel, training_cfg) -> "TorchTrainer":
        from .model.frozen import keep_weights_for_backward
        from .memory import ActivationOffload
        from .distributed import Engine, fsdp_problem

        base = unwrap(handle.model)
        checkpointing = training_cfg.gradient_checkpointing is not False   # None means the default: on
        if checkpointing:
            enable_checkpointing(base)
        # Under checkpointing a frozen layer's weight is rebuilt for the recompute right before its
        # backward: keeping that copy for the backward saves a rebuild (model/frozen.py).
        keep_weights_for_backward(base, checkpointing)
        offload = None
        if self.plan.memory is not None and self.plan.memory.activation_offload:
            offload = ActivationOffload(self.plan.device, self.plan.host)
            offload.install(base)
        if training_cfg.compile:
            from .compile import compile_layers

            compile_layers(handle.model, self.plan.name)
        if self.ranks.distributed:
            strategy = self.plan.distributed.strategy if self.plan.distributed else "ddp"
            problem = fsdp_problem(handle.adapter_type, self.plan, handle.head) if strategy == "fsdp" else None
            if problem:
                raise MudpuppyError(problem)
            # Before the optimizer is built: FSDP replaces the parameters with their shards.
            self.engine = Engine(strategy, handle.model, self.plan, self.plan.distributed, self.ranks, handle.autocast_dtype)
        return TorchTrainer(self, handle, training_cfg, offload, self.engine)

def enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing on every decoder layer (transformers 5 renamed the method)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
