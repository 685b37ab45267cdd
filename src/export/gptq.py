"""Reading a GPTQ checkpoint in the standard layout back to plain float32 weights, in numpy.

The layout AutoGPTQ, GPTQModel, transformers and llama.cpp's converter share, per quantized
linear layer `name` (out_features x in_features, `bits` of 2, 4 or 8):

    name.qweight  int32 [in * bits / 32, out]   codes packed along the input dimension, low bits first
    name.qzeros   int32 [groups, out * bits / 32] zero points packed along the output dimension
    name.scales   fp16  [groups, out]
    name.g_idx    int32 [in]                     the group of each input column (act-order permutes it)

    weight[o, i] = scales[g_idx[i], o] * (code[i, o] - zero[g_idx[i], o])

with zero = stored + 1 in the original format (`checkpoint_format: gptq`, the default) and
zero = stored in `gptq_v2`. 3-bit packing crosses word boundaries and is not read here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import MudpuppyError
from .tensors import model_tensors, write_float_model


def unpack_rows(packed: np.ndarray, bits: int) -> np.ndarray:
    """int32 [n / per_word, m] -> codes [n, m]: word r holds rows r*per_word .. (r+1)*per_word - 1."""
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    words = packed.view(np.uint32)
    codes = (words[:, None, :] >> shifts[None, :, None]) & np.uint32((1 << bits) - 1)
    return codes.reshape(-1, packed.shape[1]).astype(np.int32)


def unpack_columns(packed: np.ndarray, bits: int) -> np.ndarray:
    """int32 [g, m / per_word] -> codes [g, m]: word c holds columns c*per_word .. (c+1)*per_word - 1."""
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    words = packed.view(np.uint32)
    codes = (words[:, :, None] >> shifts[None, None, :]) & np.uint32((1 << bits) - 1)
    return codes.reshape(packed.shape[0], -1).astype(np.int32)


def dequantize_layer(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray | None,
                     bits: int, group_size: int, v1_zero_offset: bool) -> np.ndarray:
    codes = unpack_rows(qweight, bits)                        # [in, out]
    zeros = unpack_columns(qzeros, bits)[:, : scales.shape[1]]
    if v1_zero_offset:
        zeros = zeros + 1
    n_in = codes.shape[0]
    if g_idx is None:
        g_idx = np.arange(n_in) // (group_size if group_size > 0 else n_in)
    g_idx = g_idx.astype(np.int64)
    weight = scales.astype(np.float32)[g_idx] * (codes - zeros[g_idx]).astype(np.float32)
    return np.ascontiguousarray(weight.T)                     # [out, in]


def dequantize_gptq_dir(source: Path, target: Path) -> None:
    """Write the GPTQ model in `source` to `target` as a plain float32 safetensors model."""
    source, target = Path(source), Path(target)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    quant = config.get("quantization_config") or {}
    bits, group_size = int(quant.get("bits", 4)), int(quant.get("group_size", 128))
    if bits not in (2, 4, 8):
        raise MudpuppyError(f"{source}: GPTQ with {bits} bits; export reads 2, 4 and 8-bit checkpoints")
    fmt = quant.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise MudpuppyError(f"{source}: GPTQ checkpoint_format {fmt!r}; export reads gptq and gptq_v2")
    stored = model_tensors(source)
    out: dict[str, np.ndarray] = {}
    for name, tensor in stored.items():
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            missing = [s for s in (".qzeros", ".scales") if base + s not in stored]
            if missing:
                raise MudpuppyError(f"{source}: {name} has no {', '.join(base + s for s in missing)}")
            g_idx = stored.get(base + ".g_idx")
            out[base + ".weight"] = dequantize_layer(
                np.asarray(tensor.raw()), np.asarray(stored[base + ".qzeros"].raw()),
                stored[base + ".scales"].float32(), None if g_idx is None else np.asarray(g_idx.raw()),
                bits, group_size, fmt == "gptq")
        elif name.endswith((".qzeros", ".scales", ".g_idx")):
            continue
        elif tensor.is_float():
            out[name] = tensor.float32()
        else:
            raise MudpuppyError(f"{source}: tensor {name} ({tensor.dtype}) is not part of the GPTQ layout")
    write_float_model(source, target, config, out)
