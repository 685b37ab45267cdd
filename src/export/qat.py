"""Reading a converted QAT model (`quant_method: mudpuppy_qat`, backends/torch/quantization/qat/files.py's layout) back
to plain float32 weights, in numpy.

Per quantized linear layer NAME (symmetric groups, no zero points):

    NAME.qweight  int8 [out, in] codes (8-bit), or uint8 [out, in / 2] for 4-bit: two codes a byte,
                  code + 8, the even column in the low nibble
    NAME.scales   float32 [out, in / group_size] ([out, 1] for group_size -1)

    weight[o, i] = scales[o, i // group_size] * code[o, i]

The int8 dynamic activation quantization a model may have trained with is not part of the weights:
the exported model computes its activations in float.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import MudpuppyError
from .tensors import model_tensors, write_float_model

FORMAT_VERSION = 1


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    low = (packed & 0x0F).astype(np.int16) - 8
    high = (packed >> 4).astype(np.int16) - 8
    return np.stack((low, high), axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_layer(qweight: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    codes = unpack_int4(qweight) if bits == 4 else qweight.astype(np.int16)
    group = codes.shape[1] // scales.shape[1]
    return (codes.astype(np.float32) * np.repeat(scales.astype(np.float32), group, axis=1)).astype(np.float32)


def dequantize_qat_dir(source: Path, target: Path) -> None:
    """Write the converted QAT model in `source` to `target` as a plain float32 safetensors model."""
    source, target = Path(source), Path(target)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    quant = config.get("quantization_config") or {}
    bits = int(quant.get("weight_bits", 0))
    if quant.get("format_version") != FORMAT_VERSION or bits not in (4, 8):
        raise MudpuppyError(f"{source}: a mudpuppy_qat model of format_version {quant.get('format_version')} with "
                            f"{bits}-bit weights; export reads format_version {FORMAT_VERSION}, 4 or 8 bits")
    stored = model_tensors(source)
    out: dict[str, np.ndarray] = {}
    for name, tensor in stored.items():
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            if base + ".scales" not in stored:
                raise MudpuppyError(f"{source}: {name} has no {base}.scales")
            out[base + ".weight"] = dequantize_layer(np.asarray(tensor.raw()), stored[base + ".scales"].float32(), bits)
        elif name.endswith(".scales"):
            continue
        elif tensor.is_float():
            out[name] = tensor.float32()
        else:
            raise MudpuppyError(f"{source}: tensor {name} ({tensor.dtype}) is not part of the mudpuppy_qat layout")
    missing = [m for m in quant.get("modules", []) if m + ".weight" not in out]
    if missing:
        raise MudpuppyError(f"{source}: quantization_config lists {', '.join(missing[:3])} but the weights hold no "
                            "codes for them")
    write_float_model(source, target, config, out)
