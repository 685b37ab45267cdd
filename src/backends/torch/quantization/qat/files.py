"""A converted QAT model on disk (layers.py converts it): written, recognised and read back.

On-disk layout of a converted model (a transformers model directory):

    config.json        the model's config plus "quantization_config": {"quant_method":
                       "mudpuppy_qat", "format_version": 1, "weight_bits", "group_size",
                       "symmetric": true, "activations": "none" | "int8",
                       "modules": [qualified names of the quantized linear layers]}
    model.safetensors  for each quantized layer NAME:
                         NAME.qweight  int8 [out, in] codes (8-bit), or for 4-bit uint8
                                       [out, in / 2], two codes a byte: code + 8, even
                                       column in the low nibble (quantized_linear.pack_int4)
                         NAME.scales   float32 [out, in / group_size] (group_size -1: [out, 1])
                         NAME.bias     when the layer has one
                       every other tensor (embeddings, norms, output head) as transformers saves it
    tokenizer files

    weight[o, i] = scales[o, i // group_size] * code[o, i]     (symmetric: no zero points)

`load_quantized` reads it back. transformers alone cannot: it warns "Unknown quantization
type, got mudpuppy_qat ... we will skip the quantization" and leaves the quantized layers'
weights randomly initialised (its load report lists them as MISSING), so load it with
mudpuppy, or export it (mudpuppy export) to a format other tools read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .....data.tokenizers import save_tokenizer
from .....errors import MudpuppyError
from ...handle import cache_on
from .layers import FORMAT_VERSION, QUANT_METHOD, QatSpec
from ..quantized_linear import QuantizedLinear, count_bytes, pack_int4, unpack_int4


def save_quantized(model: nn.Module, tokenizer, path: str | Path) -> int:
    """Write a converted model in the layout of the module docstring; returns the bytes of its tensors."""
    spec_dict = model.config.quantization_config
    path = Path(path)
    state = model.state_dict()
    if spec_dict["weight_bits"] == 4:
        for name in spec_dict["modules"]:
            state[f"{name}.qweight"] = pack_int4(state[f"{name}.qweight"])
    with cache_on(model):            # training loaded it with the cache off; whoever loads this generates
        model.save_pretrained(str(path), state_dict=state, safe_serialization=True)
    if tokenizer is not None:
        save_tokenizer(tokenizer, path)
    return count_bytes(model)


def read_quantization_config(path: str | Path) -> dict | None:
    """The mudpuppy_qat quantization_config of a model directory, or None when it is not one."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        qc = json.loads(config.read_text(encoding="utf-8")).get("quantization_config")
    except ValueError:
        return None
    return qc if isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD else None


def is_qat_checkpoint(path: str | Path) -> bool:
    return read_quantization_config(path) is not None


def load_quantized(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                   trust_remote_code: bool = False) -> nn.Module:
    """A converted model from `save_quantized`'s layout, in eval mode on `device`; `dtype` casts the float
    tensors that are not codes or scales (embeddings, norms, output head, biases)."""
    from accelerate import init_empty_weights
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    qc = read_quantization_config(path)
    if qc is None:
        raise MudpuppyError(f"{path}: not a mudpuppy QAT model (config.json has no quantization_config with "
                            f"quant_method {QUANT_METHOD})")
    if qc.get("format_version") != FORMAT_VERSION:
        raise MudpuppyError(f"{path}: quantization_config.format_version {qc.get('format_version')} is not one "
                            f"this mudpuppy reads ({FORMAT_VERSION}); update mudpuppy")
    spec = QatSpec(int(qc["weight_bits"]), int(qc["group_size"]), qc["activations"])
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    del config.quantization_config
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code,
                                                 attn_implementation="sdpa")
    for name in qc["modules"]:
        linear = model.get_submodule(name)
        model.set_submodule(name, QuantizedLinear(linear.in_features, linear.out_features, linear.bias is not None,
                                                  spec.weight_bits, spec.group_size, spec.activations,
                                                  device="meta"))
    state = {}
    for file in _weight_files(path):
        state.update(load_file(str(file)))
    for name in qc["modules"]:
        key = f"{name}.qweight"
        if key not in state:
            raise MudpuppyError(f"{path}: {key} is missing; the checkpoint does not match its quantization_config")
        if spec.weight_bits == 4:
            state[key] = unpack_int4(state[key])
    quantized = {f"{name}.{leaf}" for name in qc["modules"] for leaf in ("qweight", "scales", "bias")}
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() and k not in quantized else v) for k, v in state.items()}
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys:
        raise MudpuppyError(f"{path}: tensors the model does not have: {', '.join(result.unexpected_keys[:3])}")
    model.tie_weights()
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise MudpuppyError(f"{path}: {len(left)} tensors missing from the checkpoint ({', '.join(left[:3])})")
    model.config.quantization_config = qc
    model.config.use_cache = False
    return model.to(device).eval()


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [path / name for name in names]
    single = path / "model.safetensors"
    if not single.is_file():
        raise MudpuppyError(f"{path}: no model.safetensors (or index) in this QAT model directory")
    return [single]
