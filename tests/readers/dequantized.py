"""mudpuppy's dequantized forward: the source model with every tensor the GGUF stores quantized (or
f16) replaced by the file's own values, dequantized by gguf-py and carried back through the inverse of
the family's transform (tests/export/test_gguf_families.py gguf_values / expected_values). Tensors the
file keeps float32 stay the source's. This is what llama.cpp should compute from the file, up to its
float arithmetic (and its quantized activations in quantized matrix products)."""

from __future__ import annotations

import copy

import numpy as np

from ..export.test_gguf_families import expected_values, gguf_values


def _parts(key: str) -> list[str]:
    """The expected_values keys a state-dict entry was split into."""
    base, bias = key.rsplit(".", 1)[0], key.endswith("_bias")
    suffix = ".bias" if bias else ".weight"
    if key.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
        return [f"{base}.gate_proj{suffix}", f"{base}.up_proj{suffix}"]
    if key.endswith(("experts.down_proj", "experts.down_proj_bias")):
        return [f"{base}.down_proj{suffix}"]
    return [key + ".weight"] if key.endswith("sinks") else [key]


def _fused(family: str, key: str, split: dict[str, np.ndarray]) -> np.ndarray:
    """The inverse of expected_values for one state-dict entry."""
    parts = [split[k] for k in _parts(key)]
    bias = key.endswith("_bias")
    if key.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
        gate, up = parts
        if family != "gptoss":
            return np.concatenate([gate, up], axis=1)
        axis = gate.ndim - 1 if bias else 1              # gpt-oss interleaves gate and up
        shape = list(gate.shape)
        shape[axis] *= 2
        v = np.empty(shape, dtype=np.float32)
        index = [slice(None)] * v.ndim
        index[axis] = slice(0, None, 2)
        v[tuple(index)] = gate
        index[axis] = slice(1, None, 2)
        v[tuple(index)] = up
        return v if bias else v.swapaxes(-1, -2)
    if key.endswith("experts.down_proj") and family == "gptoss":
        return parts[0].swapaxes(-1, -2)
    return parts[0]


def dequantized_model(family: str, model, config: dict, path):
    """A copy of `model` computing with the weights stored in the GGUF at `path`."""
    import gguf
    import torch

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     config["num_hidden_layers"])
    types = {t.name: t.tensor_type for t in reader.tensors}
    back = gguf_values(family, config, reader)
    split, stored = {}, {}
    for key in expected_values(family, model):
        if key == "lm_head.weight":
            name = "output.weight" if "output.weight" in back else "token_embd.weight"
        else:
            name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        split[key], stored[key] = back[name], types[name] != gguf.GGMLQuantizationType.F32
    rounded = copy.deepcopy(model)
    params = dict(rounded.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for key, param in params.items():
            if not any(stored[k] for k in _parts(key)):
                continue                                   # float32 in the file: the source's own
            value = torch.from_numpy(np.ascontiguousarray(_fused(family, key, split)))
            if key == "lm_head.weight":                    # untied: the head may be rounded unlike the embedding
                rounded.lm_head.weight = torch.nn.Parameter(value.clone())
            else:
                param.copy_(value.reshape(param.shape))
    return rounded.eval()
