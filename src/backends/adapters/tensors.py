"""safetensors files read and written as raw bytes, so that every tensor is copied bit for bit in its stored
dtype: bf16 included, which numpy cannot represent (it is held as uint16 bits)."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import MudpuppyError
from ...files import check_safetensors

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class AdapterError(MudpuppyError):
    """A directory that is not an adapter, or an adapter that cannot be converted."""


@dataclass
class RawTensor:
    """A tensor as stored: its safetensors dtype tag and its elements (bf16 held as uint16 bits)."""

    dtype: str
    array: np.ndarray

    def transposed(self) -> RawTensor:
        return RawTensor(self.dtype, np.ascontiguousarray(self.array.T))

    def to_float32(self) -> np.ndarray:
        if self.dtype == "BF16":
            return (self.array.astype(np.uint32) << 16).view(np.float32)
        return self.array.astype(np.float32)

    def equals(self, other: RawTensor) -> bool:
        return (self.dtype == other.dtype and self.array.shape == other.array.shape
                and self.array.tobytes() == other.array.tobytes())


def read_safetensors(path: Path) -> tuple[dict[str, RawTensor], dict[str, str]]:
    """Every tensor of a safetensors file, and its metadata."""
    check_safetensors(path)       # header and offsets against the file's size, before it is read whole
    data = Path(path).read_bytes()
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
    except (struct.error, ValueError) as exc:
        raise AdapterError(f"{path}: not a safetensors file ({exc})") from None
    meta = header.pop("__metadata__", None) or {}
    body = memoryview(data)[8 + size :]
    tensors = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise AdapterError(f"{path}: tensor {name} has dtype {info['dtype']}; adapters hold floats")
        begin, end = info["data_offsets"]
        array = np.frombuffer(body[begin:end], dtype=_DTYPES[info["dtype"]]).reshape(info["shape"])
        tensors[name] = RawTensor(info["dtype"], array.copy())
    return tensors, meta


def write_safetensors(path: Path, tensors: dict[str, RawTensor], metadata: dict[str, str]) -> None:
    """Write atomically (a temporary file, then a rename): a crash never leaves half an adapter."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    chunks, offset = [], 0
    for name in sorted(tensors):
        raw = np.ascontiguousarray(tensors[name].array).astype(_DTYPES[tensors[name].dtype], copy=False)
        blob = raw.astype(raw.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": tensors[name].dtype, "shape": list(raw.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        chunks.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format asks for an 8-byte aligned data section
    tmp = Path(str(path) + ".tmp")
    with tmp.open("wb") as fh:
        fh.write(struct.pack("<Q", len(head)))
        fh.write(head)
        for blob in chunks:
            fh.write(blob)
    os.replace(tmp, path)
