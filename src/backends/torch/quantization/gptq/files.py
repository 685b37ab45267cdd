"""GPTQ's files: the model read into host memory to be quantized, and the quantized model written in
the GPTQ layout (format.py) that transformers + optimum/gptqmodel, AutoGPTQ, GPTQModel, vLLM and
TGI read, and mudpuppy loads back (linear.py)."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from .linear import GptqLinear
from ...model.loading import FrozenPlan, compact_dtype, load_model_weights

SHARD_BYTES = 4 * 2**30


def load_host_model(directory: Path, trust_remote_code: bool = False):
    """The model of `directory` in host memory at its checkpoint's dtype (bf16 stays bf16): the layers
    visit the device one at a time."""
    dtype = compact_dtype(Path(directory)) or torch.float32
    model, _ = load_model_weights("AutoModelForCausalLM", Path(directory), dtype, torch.device("cpu"),
                                  lambda m: FrozenPlan(), trust_remote_code)
    model.config.use_cache = False
    model.eval()
    return model


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_quantized(model: nn.Module, out: Path, quantization_config: dict, source: Path | None = None) -> list[str]:
    """Write the quantized model in the GPTQ layout: safetensors (sharded past 4 GiB, with an index),
    config.json with `quantization_config`, and the source's generation_config.json. Returns the files."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = _save_tensors(_host_state(model), out)
    config = copy.deepcopy(model.config)
    config.quantization_config = quantization_config
    config.use_cache = True
    config.dtype = next(model.parameters()).dtype       # of the tensors kept in full precision
    config.save_pretrained(str(out))
    files.append("config.json")
    for name in files:                                   # safetensors writes 0600; a model is meant to be shared
        os.chmod(out / name, 0o644 & ~_umask())
    if source is not None and (Path(source) / "generation_config.json").is_file():
        shutil.copyfile(Path(source) / "generation_config.json", out / "generation_config.json")
        files.append("generation_config.json")
    return files


def _host_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors to write, in host memory: tied weights once, GPTQ layers' biases in fp16."""
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    gptq_bias = {f"{name}.bias" for name, m in model.named_modules() if isinstance(m, GptqLinear) and m.bias is not None}
    state = {}
    for key, tensor in model.state_dict().items():
        if key in tied:
            continue
        tensor = tensor.detach().to("cpu")
        state[key] = (tensor.to(torch.float16) if key in gptq_bias else tensor).contiguous().clone()
    return state


def _save_tensors(state: dict[str, torch.Tensor], out: Path) -> list[str]:
    """model.safetensors, or shards of at most SHARD_BYTES with transformers' index; returns the files."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        files.append(name)
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return files + ["model.safetensors.index.json"]
