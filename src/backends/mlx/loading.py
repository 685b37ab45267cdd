"""Load a model for MLX from the same local directory, tokenizer and chat template as torch."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from ...data.tokenizers import load_text_tokenizer
from ...errors import MudpuppyError
from ..models import patch_rope_theta, resolve_model
from ..routing import router_aux_coefficient
from .families import check_family, config_overrides, exact_yarn, model_classes, restore_windows
from .quantize import quant_format, quantize_base
from .router_loss import record_routers

DTYPES = {"auto": mx.float32, "float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
# Scalar-head models: classes per position and the transformers class-name suffix, as on torch.
HEADS = {"sequence_classification": (1, "ForSequenceClassification"),
         "token_classification": (2, "ForTokenClassification")}
HEAD_NAME = "score"    # transformers' name for the Llama-family classification head


class ScoreModel(nn.Module):
    """The decoder of an mlx-lm causal LM under a new linear `score` head, laid out as transformers'
    *ForSequenceClassification / *ForTokenClassification: parameters `model.*` and `score.*`,
    so a saved model loads there as it is. Logits [B, T, num_labels] at every position.

    As transformers: the sequence head has no bias and no dropout; the token head has a bias
    and drops hidden states (classifier_dropout, else hidden_dropout, else 0.1) while training."""

    def __init__(self, causal: nn.Module, hidden_size: int, num_labels: int, init_std: float,
                 bias: bool = False, dropout: float = 0.0):
        super().__init__()
        self.model = causal.model
        self.dropout = nn.Dropout(p=dropout) if dropout > 0 else None
        # transformers' _init_weights for a new Linear: weight N(0, initializer_range), bias zero.
        self.score = nn.Linear(hidden_size, num_labels, bias=bias)
        self.score.weight = mx.random.normal((num_labels, hidden_size)) * init_std
        if bias:
            self.score.bias = mx.zeros((num_labels,))

    @property
    def layers(self):
        return self.model.layers

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        hidden = self.model(inputs, cache)
        return self.score(self.dropout(hidden) if self.dropout is not None else hidden)


@dataclass
class MlxModel:
    """The handle the pipelines hold: an mlx-lm model with the Hugging Face tokenizer."""

    model: Any
    tokenizer: Any
    source: str
    config: dict                               # the model's config.json, rope_theta patched
    precision: str = "fp32"                    # what attach_adapter casts the frozen base to
    split_head: bool = False                   # the head can run on loss positions only (see forward.py)
    masks: bool = False                        # the model honours explicit attention masks
    packable: bool = False                     # masks and rotary positions: packed rows are exact
    head: str | None = None                    # None (causal LM) or a key of HEADS
    adapter: dict = field(default_factory=dict)  # kind, r, alpha, rslora, dropout, targets, quantization
    quantization: dict | None = None           # the 4-bit base's summary once quantized (while loading or after)
    router_aux_coef: float = 0.0               # the routers' load-balancing loss weight in training (router_loss.py)

    def describe(self) -> str:
        base = "4-bit " + self.quantization["quant_backend"] if self.quantization else self.precision
        return (f"loaded through mlx-lm's {self.config.get('model_type', 'model')} at {base}, "
                f"{'masked' if self.masks else 'causal-only'} attention"
                f"{', head on loss positions only' if self.split_head else ''}")


def load_model(model_cfg, precision: str, gpu: bool, head: str | None = None, adapter=None) -> MlxModel:
    """The model at its storage precision, read lazily and materialized one module at a time.

    mx.load is lazy: a weight is read from the checkpoint only when it is
    evaluated. Every conversion (the storage cast, QLoRA's quantization) is
    queued on the lazy weights first, and then each leaf module is evaluated
    on its own, so no full-precision copy of the whole model ever exists:
    the peak is the model as stored plus about one layer at full precision.
    The operations are the ones a load-then-convert would run, in the same
    order, so the result is bit for bit the same (and a merge, which loads
    again, rebuilds exactly the base the adapter was trained on).
    """
    from mlx_lm.utils import load_model as mlx_load_model

    from .forward import check_forward_paths, uses_rotary_positions

    if head is not None and head not in HEADS:
        raise MudpuppyError(f"unknown model head {head!r}; known: {', '.join(HEADS)}")
    precision = resolve_precision(precision, gpu)  # a refused precision should not wait for the weights
    kind = getattr(adapter, "type", None)
    quant = quant_format(adapter) if kind == "qlora" else None   # likewise a refused 4-bit format
    resolved = resolve_model(model_cfg.base_model, model_cfg.revision, model_cfg.trust_remote_code)
    raw = json.loads((Path(resolved.path) / "config.json").read_text())
    check_family(raw, f"model.base_model {model_cfg.base_model!r}")   # before any weight loads
    aux_coef = router_aux_coefficient(raw, getattr(model_cfg, "router_aux_loss_coef", None),
                                      f"model.base_model {model_cfg.base_model!r}") if head is None else 0.0
    config = patch_rope_theta(raw)
    quantized = (config.get("quantization_config") or {}).get("quant_method")
    if quantized in ("gptq", "mudpuppy_qat") and "quantization" not in config:
        # The two formats mudpuppy writes on torch; mlx-lm has no reader for either (its own
        # "quantization" key aside), so their codes would load as missing weights.
        raise MudpuppyError(f"model.base_model {model_cfg.base_model!r} holds {quantized} weights, which the mlx "
                            "backend cannot read; use a torch backend, or `mudpuppy export --format mlx` of it first")
    # The keys mlx-lm reads where transformers 5 writes them elsewhere (families.py): rope_theta above
    # all, without which mlx-lm silently falls back to 10000.
    overrides = config_overrides(raw)
    # Older mlx-lm releases take no trust_remote_code (they never run custom model code).
    remote = ({"trust_remote_code": model_cfg.trust_remote_code}
              if "trust_remote_code" in inspect.signature(mlx_load_model).parameters else {})
    try:
        model, _ = mlx_load_model(Path(resolved.path), lazy=True, model_config=overrides,
                                  get_model_classes=model_classes, **remote)
    except ValueError as exc:
        raise MudpuppyError(f"model.base_model {model_cfg.base_model!r}: mlx-lm cannot build it ({exc}); "
                            "use a torch backend for this architecture") from None
    restore_windows(model, raw)     # sliding windows mlx-lm leaves out (Gemma 2, Mistral, Phi-3...)
    exact_yarn(model, raw)          # YaRN as transformers computes it (gpt-oss: truncate false)
    if head is not None:
        model = with_score_head(model, config, head)
    # Storage, queued like everything until materialize(): model.dtype (auto: fp32, the master weights
    # of a full fine-tune); QLoRA's codes from those values, as quantizing after a full load gave them;
    # then a frozen base (no adapter, lora, dora, qlora) in the compute dtype when that is bf16.
    model.set_dtype(DTYPES[model_cfg.dtype])
    quantization = quantize_base(model, quant) if quant else None
    if kind != "none" and precision == "bf16":
        frozen_base(model, head).set_dtype(mx.bfloat16)
    materialize(model)
    model.eval()
    tokenizer = load_text_tokenizer(model_cfg, Path(resolved.path))
    handle = MlxModel(model, tokenizer, str(resolved.path), config, precision, head=head, quantization=quantization,
                      router_aux_coef=aux_coef)
    if aux_coef and not record_routers(model):
        raise MudpuppyError(f"model.base_model {model_cfg.base_model!r}: its config asks for the router "
                            "load-balancing loss, but mlx-lm's model has no router mudpuppy can read; set "
                            "model.router_aux_loss_coef: 0 or use a torch backend")
    handle.split_head, handle.masks = check_forward_paths(model)
    handle.packable = handle.masks and uses_rotary_positions(model)
    return handle


def frozen_base(model: nn.Module, head: str | None) -> nn.Module:
    """The part of the model an adapter leaves frozen: all of it, or the decoder under a new
    scalar head (the head trains in full and keeps fp32, as PEFT's modules_to_save)."""
    return model.model if head else model


def materialize(model: nn.Module) -> None:
    """Evaluate the lazily loaded weights one leaf module at a time.

    One mx.eval over the whole model could schedule every checkpoint read
    before any conversion; module by module, each full-precision weight is
    read, converted and released before the next is touched.
    """
    for _, module in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        mx.eval(module.parameters())
    mx.eval(model.parameters())    # anything held outside a leaf module


def with_score_head(causal: nn.Module, config: dict, head: str) -> ScoreModel:
    """The causal LM's decoder under a fresh score head (the LM head is dropped, as transformers does)."""
    if not callable(getattr(causal, "model", None)) or "hidden_size" not in config:
        raise MudpuppyError(f"a {head} head needs a decoder-then-head model with a hidden_size; "
                            f"mlx-lm's {type(causal).__name__} is not one; use a torch backend")
    num_labels, std = HEADS[head][0], config.get("initializer_range", 0.02)
    if head == "sequence_classification":
        return ScoreModel(causal, config["hidden_size"], num_labels, std)
    dropout = next((config[k] for k in ("classifier_dropout", "hidden_dropout") if config.get(k) is not None), 0.1)
    bias = config.get("token_classification_bias", True)
    return ScoreModel(causal, config["hidden_size"], num_labels, std, bias=bias, dropout=dropout)


def head_config(config: dict, head: str, pad_token_id: int | None) -> dict:
    """config.json for a scalar-head model, as transformers writes it: the class, the labels, and the
    pad id by which the sequence score finds each row's last real token."""
    num_labels, suffix = HEADS[head]
    arches = [a.replace("ForCausalLM", suffix) for a in config.get("architectures") or []]
    labels = {str(i): f"LABEL_{i}" for i in range(num_labels)}
    return {**config, "architectures": arches, "id2label": labels, "label2id": {v: int(k) for k, v in labels.items()},
            "pad_token_id": pad_token_id}


def resolve_precision(precision: str, gpu: bool) -> str:
    """fp32 or bf16 for the frozen base weights under an adapter.

    auto is bf16 on a Metal GPU (mlx-lm's own default: a bf16 base, fp32
    adapters) and fp32 on the CPU build, whose bf16 is no faster.
    """
    if precision in ("fp32", "bf16"):
        return precision
    if precision == "auto":
        return "bf16" if gpu else "fp32"
    raise MudpuppyError(f"training.precision {precision!r} is not available on MLX; use auto, fp32 or bf16")


def count_parameters(model: nn.Module, trainable: bool = False) -> int:
    """Parameters as numbers, counting a quantized weight by the values it packs, not its uint32 words."""
    total = 0
    modules = dict(model.named_modules())
    params = model.trainable_parameters() if trainable else model.parameters()
    for name, value in tree_flatten(params):
        owner, _, leaf = name.rpartition(".")
        mod = modules.get(owner)
        if isinstance(mod, nn.QuantizedLinear):
            if leaf in ("scales", "biases"):
                continue
            if leaf == "weight":
                total += value.size * 32 // mod.bits
                continue
        total += value.size
    return total
