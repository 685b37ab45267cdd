"""Reading a Hugging Face model directory's safetensors as numpy, one tensor at a time.

The GGUF writer streams: it learns every tensor's name, dtype and shape from the
headers first, then reads, converts and writes one tensor at a time, so a model
never sits in memory twice. safetensors' own numpy loader refuses bfloat16
(numpy has no such type); the format is simple enough to read directly: an
8-byte header length, a JSON header, then the raw little-endian bytes.
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import MudpuppyError

# safetensors dtype -> (numpy dtype of the stored bytes, bytes per element)
_FLOAT_DTYPES = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2)}


@dataclass(frozen=True)
class StoredTensor:
    name: str
    file: Path
    dtype: str                 # the safetensors dtype name: F32, F16, BF16, I32, ...
    shape: tuple[int, ...]
    start: int                 # absolute byte offset in the file
    end: int

    def is_float(self) -> bool:
        return self.dtype in _FLOAT_DTYPES

    def raw(self) -> np.ndarray:
        """The stored values in their own dtype (BF16 as uint16 bit patterns); memory-mapped."""
        np_dtype = _FLOAT_DTYPES.get(self.dtype, (None, 0))[0] or _INT_DTYPES.get(self.dtype)
        if np_dtype is None:
            raise MudpuppyError(f"{self.file}: tensor {self.name} is stored as {self.dtype}, which export cannot read")
        count = int(np.prod(self.shape)) if self.shape else 1
        data = np.memmap(self.file, dtype=np_dtype, mode="r", offset=self.start, shape=(count,))
        return data.reshape(self.shape)

    def float32(self) -> np.ndarray:
        """The tensor as float32 (exact for F32, F16 and BF16)."""
        if not self.is_float():
            raise MudpuppyError(f"{self.file}: tensor {self.name} is {self.dtype}, not a float tensor; is this a "
                                "quantized checkpoint? Export reads plain F32/F16/BF16 weights")
        raw = np.asarray(self.raw())
        if self.dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(np.float32)


_INT_DTYPES = {"I32": np.int32, "I64": np.int64, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def read_header(path: Path) -> dict[str, StoredTensor]:
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise MudpuppyError(f"{path}: not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", head)
        try:
            header = json.loads(fh.read(length))
        except (ValueError, UnicodeDecodeError) as exc:
            raise MudpuppyError(f"{path}: not a safetensors file ({exc})") from exc
    base = 8 + length
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = StoredTensor(name, path, info["dtype"], tuple(info["shape"]), base + begin, base + end)
    return out


def model_tensors(model_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor of the model in `model_dir` (one file, or shards listed by the index)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        paths = [model_dir / f for f in files]
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise MudpuppyError(f"{model_dir}: no *.safetensors weights to export (a .bin-only checkpoint? "
                            "load it with transformers and save_pretrained it as safetensors first)")
    tensors: dict[str, StoredTensor] = {}
    for path in paths:
        if not path.is_file():
            raise MudpuppyError(f"{index}: lists {path.name}, which is missing")
        tensors.update(read_header(path))
    return tensors


def copy_tokenizer_files(source: Path, target: Path) -> None:
    """The files beside the weights that make a model directory usable: tokenizer, chat template,
    generation config."""
    for pattern in ("tokenizer*", "special_tokens_map.json", "chat_template.*", "generation_config.json",
                    "*.tiktoken", "vocab.json", "merges.txt"):
        for f in Path(source).glob(pattern):
            if f.is_file():
                shutil.copy2(f, Path(target) / f.name)


def write_float_model(source: Path, target: Path, config: dict, weights: dict[str, np.ndarray]) -> None:
    """`target` as a plain float32 model directory: `weights`, `config` without its quantization_config,
    and `source`'s tokenizer files. What every dequantizer (export/source.py DEQUANTIZERS) ends with."""
    from safetensors.numpy import save_file

    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    plain["dtype"] = "float32"
    (target / "config.json").write_text(json.dumps(plain, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    copy_tokenizer_files(source, target)
