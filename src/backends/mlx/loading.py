"""Load a model for MLX from the same local directory, tokenizer and chat template as torch."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn

from ...errors import MudpuppyError
from ..models import patch_rope_theta, resolve_model

DTYPES = {"auto": mx.float32, "float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


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
    adapter: dict = field(default_factory=dict)  # kind, r, alpha, rslora, dropout, targets, quantization


def load_model(model_cfg, precision: str, gpu: bool) -> MlxModel:
    from mlx_lm.utils import load_model as mlx_load_model

    from .forward import check_forward_paths, uses_rotary_positions

    precision = resolve_precision(precision, gpu)  # a refused precision should not wait for the weights
    resolved = resolve_model(model_cfg.base_model, model_cfg.revision, model_cfg.trust_remote_code)
    config = patch_rope_theta(json.loads((Path(resolved.path) / "config.json").read_text()))
    # rope_theta (and rope_scaling) passed explicitly: mlx-lm reads only the top-level
    # keys, which transformers 5 no longer writes, and would silently fall back to 10000.
    overrides = {k: config[k] for k in ("rope_theta", "rope_scaling") if k in config}
    # Older mlx-lm releases take no trust_remote_code (they never run custom model code).
    remote = ({"trust_remote_code": model_cfg.trust_remote_code}
              if "trust_remote_code" in inspect.signature(mlx_load_model).parameters else {})
    try:
        model, _ = mlx_load_model(Path(resolved.path), model_config=overrides, **remote)
    except ValueError as exc:
        raise MudpuppyError(f"model.base_model {model_cfg.base_model!r}: mlx-lm cannot build it ({exc}); "
                            "use a torch backend for this architecture") from None
    model.set_dtype(DTYPES[model_cfg.dtype])
    model.eval()
    tokenizer = load_tokenizer(model_cfg, Path(resolved.path))
    handle = MlxModel(model, tokenizer, str(resolved.path), config, precision)
    handle.split_head, handle.masks = check_forward_paths(model)
    handle.packable = handle.masks and uses_rotary_positions(model)
    return handle


def load_tokenizer(model_cfg, default_path: Path):
    """The Hugging Face tokenizer, set up exactly as the torch backend does, so batches are identical."""
    from transformers import AutoTokenizer

    source = model_cfg.tokenizer or str(default_path)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=model_cfg.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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
    from mlx.utils import tree_flatten

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
