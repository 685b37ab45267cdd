"""A GGUF file's header walked and bounded before any GGUF reader sees it; the ranges of GGUF values.

gguf's `GGUFReader` (and transformers' GGUF loader, built on it) trusts the header's counts: a file
that claims 2^62 tensors or key-value pairs ends in an IndexError or KeyError traceback, and a 150-byte
file whose array claims 2^40 items loops over them, taking gigabytes or crashing. `check_gguf` walks the
same header with `struct` over a read-only map of the file, and bounds every count and length by the
bytes that remain before anything is built, so such a file ends in one message naming it.

The format (version 2 and 3, either byte order): magic, version, tensor count, key-value count; each
key-value pair a string key, a value type and the value (strings and arrays carry their length); then
each tensor's name, dimensions, type and offset into the data that starts, aligned, after the header.

`value_problem` says whether a value fits a GGUF value type, for the writer's side (export).
"""

from __future__ import annotations

import math
import mmap
import numbers
import struct
from pathlib import Path

from .files import CorruptFile

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4                 # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4          # arrays of arrays: llama.cpp writes none; a few levels is generous
DEFAULT_ALIGNMENT = 32

# GGUF value type -> struct format of a fixed-size value (8 string, 9 array: variable length).
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32",
              7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}


class _Header:
    """A cursor over the mapped file that refuses to read past its end."""

    def __init__(self, data, order: str):
        self.data, self.order, self.pos = data, order, 0

    def remaining(self) -> int:
        return len(self.data) - self.pos

    def take(self, fmt: str):
        size = struct.calcsize(self.order + fmt)
        if size > self.remaining():
            raise _Bad(f"it ends inside the header (at byte {self.pos:,}, reading {size} more)")
        value = struct.unpack_from(self.order + fmt, self.data, self.pos)[0]
        self.pos += size
        return value

    def count(self, what: str, least_each: int) -> int:
        """A uint64 count of items of at least `least_each` bytes, bounded by what the file still holds."""
        claimed = self.take("Q")
        if claimed * least_each > self.remaining():
            raise _Bad(f"the header claims {claimed:,} {what}, more than the {self.remaining():,} bytes left "
                       "in the file can hold")
        return claimed

    def string(self, what: str) -> str:
        length = self.count(f"bytes of {what}", 1)
        raw = bytes(self.data[self.pos:self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"{what} at byte {self.pos - length:,} is not UTF-8 text") from None

    def skip(self, nbytes: int) -> None:
        self.pos += nbytes


class _Bad(Exception):
    """What is wrong with the header; check_gguf adds the file's name."""


def check_gguf(path: str | Path) -> None:
    """Raise CorruptFile (naming `path`) unless the file's header, every count, length and tensor extent in
    it, fits inside the file. Costs one pass over the header, never over the tensor data."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, 2)
            if size < 24:
                raise _Bad(f"it is {size} bytes long, shorter than a GGUF header")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _walk(data)
    except _Bad as exc:
        raise CorruptFile(f"{path}: not a usable GGUF file: {exc}; the file is damaged, cut short or was not "
                          "written as a GGUF model") from None
    except OSError as exc:
        raise CorruptFile(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _walk(data) -> None:
    if bytes(data[:4]) != MAGIC:
        raise _Bad(f"it does not start with the GGUF magic (found {bytes(data[:4])!r})")
    version = struct.unpack_from("<I", data, 4)[0]
    order = ">" if version & 0xFFFF == 0 else "<"      # a file written on a big-endian machine
    header = _Header(data, order)
    header.skip(4)
    version = header.take("I")
    if version not in VERSIONS:
        raise _Bad(f"GGUF version {version} (readers take {' and '.join(map(str, VERSIONS))})")
    tensors = header.take("Q")
    pairs = header.count("key-value pairs", 8 + 4 + 1)          # key length, value type, one byte of value
    alignment = DEFAULT_ALIGNMENT
    keys: set[str] = set()
    for _ in range(pairs):
        key = header.string("a key")
        if key in keys:
            raise _Bad(f"the key {key[:80]!r} appears twice")
        keys.add(key)
        vtype = header.take("I")
        value = _value(header, vtype, key, 0)
        if key == "general.alignment":
            if vtype != 4 or value == 0 or value & (value - 1):
                raise _Bad(f"general.alignment must be a uint32 power of two (found {value!r})")
            alignment = value
    if tensors * (8 + 4 + 4 + 8) > header.remaining():           # name length, dims count, type, offset
        raise _Bad(f"the header claims {tensors:,} tensors, more than the {header.remaining():,} bytes left "
                   "in the file can hold")
    extents = [_tensor(header) for _ in range(tensors)]
    _check_extents(extents, -(-header.pos // alignment) * alignment, len(data))


def _value(header: _Header, vtype: int, key: str, depth: int):
    """Walk one value of type `vtype`; return it for scalars (None otherwise)."""
    if vtype in SCALARS:
        return header.take(SCALARS[vtype])
    if vtype == STRING:
        header.string(f"the value of {key[:80]!r}")
        return None
    if vtype != ARRAY:
        raise _Bad(f"the key {key[:80]!r} has an unknown value type {vtype}")
    if depth >= MAX_ARRAY_DEPTH:
        raise _Bad(f"the value of {key[:80]!r} nests arrays more than {MAX_ARRAY_DEPTH} deep")
    item = header.take("I")
    if item in SCALARS:
        each = struct.calcsize(SCALARS[item])
        header.skip(each * header.count(f"items in the array {key[:80]!r}", each))
    elif item in (STRING, ARRAY):
        for _ in range(header.count(f"items in the array {key[:80]!r}", 8 if item == STRING else 12)):
            _value(header, item, key, depth + 1)
    else:
        raise _Bad(f"the array {key[:80]!r} has an unknown item type {item}")
    return None


def _tensor(header: _Header) -> tuple[str, int, int]:
    """(name, offset into the data, bytes) of the next tensor's description."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    name = header.string("a tensor name")
    n_dims = header.take("I")
    if n_dims > MAX_DIMS:
        raise _Bad(f"tensor {name[:80]!r} claims {n_dims:,} dimensions (at most {MAX_DIMS})")
    dims = [header.take("Q") for _ in range(n_dims)]
    raw_type = header.take("I")
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
    except (ValueError, KeyError):
        raise _Bad(f"tensor {name[:80]!r} has an unknown type {raw_type}") from None
    if dims and dims[0] % block:
        raise _Bad(f"tensor {name[:80]!r}: its rows ({dims[0]:,}) are not whole blocks of {block}")
    elements = math.prod(dims)                       # Python ints: numpy's product would wrap at 2^64
    return name, header.take("Q"), elements * type_size // block


def _check_extents(extents: list[tuple[str, int, int]], data_start: int, file_size: int) -> None:
    names: set[str] = set()
    for name, offset, nbytes in extents:
        if name in names:
            raise _Bad(f"the tensor {name[:80]!r} appears twice")
        names.add(name)
        if data_start + offset + nbytes > file_size:
            raise _Bad(f"tensor {name[:80]!r} claims {nbytes:,} bytes at offset {offset:,} of the data, past the "
                       f"end of the file ({file_size:,} bytes)")


# --------------------------------------------------------------------------- the writer's side

RANGES = {"uint8": (0, 2**8 - 1), "int8": (-2**7, 2**7 - 1), "uint16": (0, 2**16 - 1), "int16": (-2**15, 2**15 - 1),
          "uint32": (0, 2**32 - 1), "int32": (-2**31, 2**31 - 1), "uint64": (0, 2**64 - 1), "int64": (-2**63, 2**63 - 1)}
FLOAT_MAX = {"float32": 3.4028234663852886e38, "float64": 1.7976931348623157e308}


def value_problem(value, type_name: str) -> str | None:
    """Why `value` cannot be stored as a GGUF `type_name` ("uint32", "float32", ...), or None."""
    if type_name in RANGES and not isinstance(value, bool):
        low, high = RANGES[type_name]
        if not isinstance(value, numbers.Integral) or not low <= int(value) <= high:
            return f"{value!r:.60} does not fit a GGUF {type_name} ({low:,} to {high:,})"
    elif type_name in FLOAT_MAX:
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            return f"{value!r:.60} is not a number"
        if not math.isfinite(number) or abs(number) > FLOAT_MAX[type_name]:
            return f"{value!r:.60} does not fit a GGUF {type_name} (a finite number up to {FLOAT_MAX[type_name]:.4g})"
    return None
