"""The MLX implementation of the backend protocol (mlx + mlx-lm).

Mirrors `backends/torch/backend.py` method for method: the same model
directory and Hugging Face tokenizer, PEFT's LoRA/DoRA formulas, the same
loss, accumulation, clipping and optimizers, and adapters saved in PEFT's
format (plus mlx-lm's in `mlx/`), and scalar-head (reward) models built as
transformers builds them. What MLX cannot do yet is refused with
an error that names the option, never handed to torch behind the user's back.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ...data.tokenizers import save_tokenizer
from ...errors import MudpuppyError
from ..adapters import choose_target_modules, choose_target_parameters
from ..protocol import AdapterInfo, Sampling
from . import adapter_io, forward, generation, logprobs
from .forward import eval_mode
from .gptq import MlxGptq
from .layers import (
    adapter_layers,
    adapters_disabled,
    linear_layers,
    merge_adapters,
    wrap_linears,
)
from .experts import SPLITS, TARGETS, expert_adapters, expert_modules, router_paths, wrap_experts
from .families import check_expert_targets, family_name
from .loading import DTYPES, HEAD_NAME, MlxModel, count_parameters, frozen_base, head_config, load_model
from .ops import MlxOps
from .quantize import quant_format, quantize_base
from .router_loss import router_aux_loss, router_tape
from .state import load_training_state, save_training_state
from .trainer import MlxTrainer


class MlxBackend:
    name = "mlx"
    adapter_layouts = ("mlx", "peft")   # adapter_io.py reads both
    transformers_model = False

    def __init__(self, device: str, gpu: bool):
        from .distributed import join

        self.device = device
        self.gpu = gpu
        self.ops = MlxOps()
        self.ranks = join()         # rank 0 of 1 unless mlx.launch / --nproc started several

    # ------------------------------------------------------------------ models
    def load_model(self, model_cfg, precision: str = "auto", head: str | None = None, adapter=None) -> MlxModel:
        """The model at its storage precision (loading.py). `model.dtype: auto` keeps a frozen base
        (no adapter, or lora/dora/qlora) in the compute dtype and weights trained in full
        (adapter.type none) in fp32; with a qlora adapter each linear layer is quantized as it is read."""
        from ...data.vision import MLX_VISION, is_vision_model

        if is_vision_model(model_cfg):      # refused before anything loads
            raise MudpuppyError(f"model {model_cfg.base_model} is a vision-language model: {MLX_VISION}")
        return load_model(model_cfg, precision, self.gpu, head, adapter)

    def save_model(self, handle: MlxModel, path: str) -> None:
        """A full model as transformers saves one: config.json, model.safetensors, tokenizer."""
        if adapter_layers(handle.model) or expert_adapters(handle.model):
            raise MudpuppyError("save_model: this model carries an adapter; save it with save_adapter")
        if any(k.endswith(".scales") for k, _ in tree_flatten(handle.model.parameters())):
            raise MudpuppyError("save_model: the base is quantized (QLoRA); save the adapter instead")
        if not self.ranks.is_main:      # rank 0 of a distributed run writes the run's outputs
            return
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        weights = dict(tree_flatten(handle.model.parameters()))
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
        dtype = next(iter(weights.values())).dtype
        config = {**handle.config, "dtype": {v: k for k, v in DTYPES.items() if k != "auto"}[dtype]}
        if handle.head:
            config = head_config(config, handle.head, handle.tokenizer.pad_token_id)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_tokenizer(handle.tokenizer, out)

    # ---------------------------------------------------------------- adapters
    def quantize_base(self, handle: MlxModel, adapter_cfg) -> dict:
        """QLoRA's frozen 4-bit base through mx.quantize (affine int4 or mxfp4); returns its summary.

        A base quantized while loading (load_model with this adapter) is not
        quantized twice: its summary comes back as it is.
        """
        name = quant_format(adapter_cfg)
        if handle.quantization is None:
            handle.quantization = quantize_base(handle.model, name)
        elif handle.quantization["quant_backend"] != name:
            raise MudpuppyError(f"adapter.quant_backend {name}: this base was already quantized to "
                                f"{handle.quantization['quant_backend']}; load the model again for {name}")
        return handle.quantization

    def attach_adapter(self, handle: MlxModel, adapter_cfg, batches=None) -> AdapterInfo:
        if getattr(adapter_cfg, "init", "default") == "eva":      # A from torch's PEFT EVA (eva.py)
            from .eva import attach_eva

            return attach_eva(self, handle, adapter_cfg, batches)
        if getattr(adapter_cfg, "init", "default") == "loftq":   # A, B from MLX's own 4-bit error (loftq.py)
            from .loftq import attach_loftq

            return attach_loftq(self, handle, adapter_cfg)
        model = handle.model
        kind = adapter_cfg.type
        if kind == "none":
            if handle.precision == "bf16":
                raise MudpuppyError("training.precision bf16 with adapter.type none: MLX would train bf16 "
                                    "weights without fp32 master copies; use training.precision fp32")
            if handle.quantization is not None:
                raise MudpuppyError("adapter.type none: this model's base was quantized for QLoRA when it was "
                                    "loaded, and 4-bit weights cannot train in full; load it again without the adapter")
            model.unfreeze()
            handle.adapter = {"kind": "none"}
            info_targets: list[str] = []
        else:
            if kind not in ("lora", "dora", "qlora"):
                raise MudpuppyError(f"adapter.type {kind!r} is not available on MLX; use none, lora, dora or qlora")
            quantization = None
            if kind == "qlora":
                quantization = self.quantize_base(handle, adapter_cfg)
            elif handle.quantization is not None:
                raise MudpuppyError(f"adapter.type {kind}: this model's base was quantized for QLoRA when it was "
                                    "loaded; load it again without the qlora adapter")
            if handle.precision == "bf16":
                # The frozen base (already so when load_model knew the adapter); adapter weights below are
                # created in fp32, and a scalar head, trained in full, stays fp32 as PEFT's modules_to_save.
                frozen_base(model, handle.head).set_dtype(mx.bfloat16)
            check_expert_targets(model, handle.config, adapter_cfg.target_modules)
            glus = expert_modules(model) if handle.config.get("model_type") in SPLITS else {}
            if glus and getattr(adapter_cfg, "train_router", False):
                raise MudpuppyError(f"adapter.train_router: the router of {family_name(handle.config)} trains "
                                    "in full on torch backends only; on mlx it stays frozen (remove the key)")
            leaves, experts = self._targets(model, adapter_cfg.target_modules, bool(glus))
            if experts and (kind == "dora" or adapter_cfg.dropout):
                raise MudpuppyError(
                    f"adapter: this model's experts are fused tensors ({', '.join(experts)}), which PEFT adapts "
                    f"without {'DoRA' if kind == 'dora' else 'dropout'}; use adapter.type lora (or qlora) "
                    "with adapter.dropout: 0, or list target_modules without the experts")
            routers = router_paths(model)
            paths = sorted(p for p in linear_layers(model) if p.rsplit(".", 1)[-1] in leaves and p not in routers)
            scale = adapter_cfg.alpha / (adapter_cfg.r ** 0.5 if adapter_cfg.rslora else adapter_cfg.r)
            layer_kind = "dora" if kind == "dora" else "lora"
            wrap_linears(model, paths, layer_kind, adapter_cfg.r, scale, adapter_cfg.dropout)
            if experts:     # PEFT's target_parameters LoRA on the fused experts (experts.py)
                wrap_experts(model, sorted(glus), adapter_cfg.r, scale, SPLITS[handle.config["model_type"]][1],
                             experts)
            if handle.head:
                model[HEAD_NAME].unfreeze()  # a new head is never a target: it trains in full (PEFT's modules_to_save)
            handle.adapter = {"kind": layer_kind, "r": adapter_cfg.r, "alpha": adapter_cfg.alpha,
                              "rslora": adapter_cfg.rslora, "dropout": adapter_cfg.dropout, "targets": leaves,
                              "quantization": quantization, "experts": experts}
            info_targets = leaves + experts
            adapter_io.initialise(handle, getattr(adapter_cfg, "init", "default"))
            if getattr(adapter_cfg, "init_from", None):
                adapter_io.start_from(handle, adapter_cfg.init_from)
        mx.eval(model.parameters())
        return AdapterInfo(kind, count_parameters(model, trainable=True), count_parameters(model), info_targets)

    @staticmethod
    def _targets(model, wanted, experts: bool) -> tuple[list[str], list[str]]:
        """Leaf names of the linear layers to adapt, and the fused expert tensors (PEFT's target_parameters
        names) where the model's experts can take PEFT's adapter. Neither the output head nor a router
        (an nn.Linear on MLX, not on torch) is a target, as on torch."""
        routers = router_paths(model)
        linear = {p.rsplit(".", 1)[-1] for p in linear_layers(model) if p not in routers}
        parameters = set(TARGETS) if experts else set()
        return choose_target_modules(linear, wanted, parameters), choose_target_parameters(parameters, wanted)

    def save_adapter(self, handle: MlxModel, path: str) -> None:
        if self.ranks.is_main:
            adapter_io.save_adapter(handle, path)

    def load_adapter(self, handle: MlxModel, path: str, trainable: bool = False) -> None:
        adapter_io.load_adapter(handle, path, trainable)

    def merge_and_save(self, handle: MlxModel, path: str, dtype: str = "bfloat16") -> None:
        """Fold the adapter into the base weights (in place) and save a plain transformers model."""
        merge_adapters(handle.model)
        handle.model.set_dtype(DTYPES[dtype])
        handle.adapter, handle.quantization = {"kind": "none"}, None   # the 4-bit base is dequantized now
        self.save_model(handle, path)

    # --------------------------------------------------------- training state
    def save_training_state(self, handle: MlxModel, trainer: MlxTrainer, path: str) -> None:
        if self.ranks.is_main:          # every rank holds the same state: rank 0 writes it
            save_training_state(self, handle, trainer, path)

    def load_training_state(self, handle: MlxModel, trainer: MlxTrainer, path: str) -> None:
        load_training_state(self, handle, trainer, path)

    # ----------------------------------------------------------------- compute
    def host_backend(self) -> "MlxBackend":
        return self                     # one memory: the GPU's is the host's

    def memory_peaks(self) -> dict[str, int]:
        peak = int(mx.get_peak_memory())
        mx.reset_peak_memory()
        return {"allocated": peak}

    def seed(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        mx.random.seed(seed)

    # ------------------------------------------------------ quantization recipes
    def plan_gptq(self, gptq_cfg) -> MlxGptq:
        """mlx-lm's GPTQ (gptq.py), refused at every setting it cannot honour."""
        return MlxGptq(self, gptq_cfg)

    def input_squares(self, handle, sequences):
        raise MudpuppyError("an importance matrix is collected on torch (--imatrix auto exports through the cpu, "
                            "cuda or rocm backend); mlx has no collector")

    def plan_qat(self, qat_cfg):
        raise MudpuppyError("method qat: the mlx backend has no fake quantization (torchao's QAT is torch only); "
                            "run it with --backend cpu (or cuda / rocm)")

    def create_trainer(self, handle: MlxModel, training_cfg) -> MlxTrainer:
        return MlxTrainer(handle, training_cfg, self.ranks)

    def evaluate_loss(self, handle: MlxModel, batches) -> tuple[float, int]:
        handle.model.eval()
        total, count = 0.0, 0
        for batch in batches:
            if batch.loss_tokens == 0:
                continue
            total += forward.loss_sum(handle, batch).item()
            count += batch.loss_tokens
        return total, count

    def sequence_logprobs(self, handle: MlxModel, batch, grad: bool = True, router_aux: bool = False):
        """Summed log p(target) per row [B] (gradient flows inside a training step unless `grad`
        is off), and the loss-carrying tokens per row. Without `grad` the model runs in eval
        mode (no dropout), as on torch. `router_aux`: a third item, the routers' weighted
        load-balancing loss of the same forward (router_loss.py; zero where the run adds none)."""
        with router_tape(router_aux and handle.router_aux_coef > 0) as tape:
            if grad:
                sums, counts = forward.sequence_logprobs(handle, batch)
            else:
                with eval_mode(handle.model):
                    sums, counts = forward.sequence_logprobs(handle, batch)
                sums = mx.stop_gradient(sums)
        if not router_aux:
            return sums, counts
        return sums, counts, self._router_aux(handle, tape, batch, grad)

    def reference_logprobs(self, handle: MlxModel, batch) -> mx.array:
        """The same, with the adapter switched off: the base model is the reference, no second copy."""
        with adapters_disabled(handle.model), eval_mode(handle.model):
            sums, _ = forward.sequence_logprobs(handle, batch)
            return mx.stop_gradient(sums)

    def token_logprobs(self, handle: MlxModel, batch, grad: bool = True, temperature: float = 1.0,
                       reference: bool = False, entropy: bool = False, router_aux: bool = False):
        """log p(target) under logits / temperature at every label != -100 position, row-major [N] float32,
        and the entropy there (numpy) when asked; the head runs a chunk of positions at a time (logprobs.py).
        `reference`: adapter off, eval mode, no gradient; without `grad`: eval mode, no gradient.
        `router_aux`: a third item, as sequence_logprobs'."""
        if router_aux:
            with router_tape(handle.router_aux_coef > 0) as tape:
                logps, entropies = self.token_logprobs(handle, batch, grad, temperature, reference, entropy)
            return logps, entropies, self._router_aux(handle, tape, batch, grad and not reference)
        if reference:
            with adapters_disabled(handle.model), eval_mode(handle.model):
                logps, entropies = logprobs.token_logprobs(handle, batch, temperature, entropy)
                return mx.stop_gradient(logps), entropies
        if grad:
            return logprobs.token_logprobs(handle, batch, temperature, entropy)
        with eval_mode(handle.model):
            logps, entropies = logprobs.token_logprobs(handle, batch, temperature, entropy)
        return mx.stop_gradient(logps), entropies

    def token_divergence(self, handle: MlxModel, teacher: MlxModel, batch, divergence, grad: bool = True,
                         temperature: float = 1.0, top_k: int = 0) -> mx.array:
        """Distillation's loss, the heads a chunk of positions at a time (divergence.py)."""
        from .divergence import token_divergence

        return token_divergence(handle, teacher, batch, divergence, grad, temperature, top_k)

    @staticmethod
    def _router_aux(handle: MlxModel, tape: list | None, batch, grad: bool) -> mx.array:
        if tape is None:
            return mx.zeros(())
        term = router_aux_loss(handle, tape, batch)
        return term if grad else mx.stop_gradient(term)

    def sequence_scores(self, handle: MlxModel, batch, grad: bool = True) -> mx.array:
        """The score per row [B], at each row's last real token (transformers' rule)."""
        self._require_head(handle, "sequence_classification")
        return self._scores(forward.sequence_scores, handle, batch, grad)

    def token_scores(self, handle: MlxModel, batch, grad: bool = True) -> mx.array:
        """Logits [N, classes] where batch.labels != -100, row-major."""
        self._require_head(handle, "token_classification")
        return self._scores(forward.token_scores, handle, batch, grad)

    @staticmethod
    def _scores(fn, handle: MlxModel, batch, grad: bool) -> mx.array:
        """As sequence_logprobs: without `grad`, eval mode (no dropout) and no gradient."""
        if grad:
            return fn(handle, batch)
        with eval_mode(handle.model):
            return mx.stop_gradient(fn(handle, batch))

    @staticmethod
    def _require_head(handle: MlxModel, head: str) -> None:
        if handle.head != head:
            raise MudpuppyError(f"this model was loaded with head {handle.head or 'causal_lm'!r}; "
                                f"scores need load_model(..., head={head!r})")

    def logits(self, handle: MlxModel, batch) -> np.ndarray:
        handle.model.eval()
        return forward.logits(handle, batch)

    def generate(self, handle: MlxModel, prompts: list[list[int]], max_new_tokens: int,
                 stop_ids: list[int]) -> list[list[int]]:
        """Greedy decoding, one prompt at a time with a KV cache.

        Without padding each prompt computes exactly what torch computes for
        its real tokens under a left-padded batch.
        """
        from mlx_lm.models.cache import make_prompt_cache

        model = handle.model
        model.eval()
        stop = set(stop_ids)
        results = []
        for prompt in prompts:
            cache = make_prompt_cache(model)
            logits = model(mx.array(prompt)[None], cache=cache)
            out: list[int] = []
            while len(out) < max_new_tokens:
                token = int(mx.argmax(logits[0, -1]).item())
                if token in stop:
                    break
                out.append(token)
                logits = model(mx.array([[token]]), cache=cache)
            results.append(out)
        return results

    def sample(self, handle: MlxModel, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
               sampling: Sampling, seed: int) -> list[list[int]]:
        """Sampled continuations, batched with a KV cache (generation.py says how prompts are batched);
        a row keeps its first stop token. Eval mode while sampling, the trainer's mode after."""
        with eval_mode(handle.model):
            return generation.sample(handle, prompts, max_new_tokens, stop_ids, sampling, seed)

    def stream(self, handle: MlxModel, prompt: list[int], max_new_tokens: int, stop_ids: list[int],
               sampling: Sampling | None, seed: int, on_token) -> None:
        """One prompt, token by token (streaming.py): the ids generate / sample would give."""
        from .streaming import stream_ids

        stream_ids(self, handle, prompt, max_new_tokens, stop_ids, sampling, seed, on_token)

    def open_decoder(self, handle: MlxModel):
        """Continuous batching for `mudpuppy serve` (batch_decode.py)."""
        from .batch_decode import open_decoder

        return open_decoder(handle)
