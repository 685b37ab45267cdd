"""What a dataset's records are once read, and which files hold them.

A `Record` is one record as a plain dict, tagged with the row and (where the file has lines) the line it
came from; a `Problem` is a bad record kept instead of raised when `skip_bad_records` is on. Files are told
from hub dataset names, and their format from their suffix, here; they are read record by record in
sources.py (text_source.py, stream_json.py, stream_tables.py, stream_hub.py). Nothing here knows about
formats: see `formats.py`. Every record is held to `data.max_record_bytes` and to one value per key
(`limits.py`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataError
from .limits import DuplicateKey, duplicate_column, oversize, record_size, unique_keys

LOCAL_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".parquet")
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zip")


@dataclass
class Record:
    data: dict
    row: int                  # 1-based position among the file's records
    line: int | None = None   # 1-based line in the file, where the file has lines

    def where(self) -> str:
        return f"line {self.line}" if self.line is not None else f"row {self.row}"


@dataclass
class Problem:
    """A bad record, kept instead of raised when `skip_bad_records` is on."""

    line: int | None
    message: str


@dataclass
class RawSource:
    name: str                          # file path or hub name, as shown to the user
    records: list[Record]
    fingerprint: str                   # changes whenever the content does
    problems: list[Problem] = field(default_factory=list)


def record_error(name: str, record: Record, message: str) -> DataError:
    """A DataError at a record: file:line when the file has lines, else 'row N' in the message."""
    if record.line is not None:
        return DataError(name, record.line, message)
    return DataError(name, None, f"row {record.row}: {message}")


def is_local(path: Path) -> bool:
    """A data file (present or not) rather than a hub dataset name."""
    return path.exists() or data_suffix(path) in LOCAL_SUFFIXES


def data_suffix(path: Path) -> str:
    """The suffix naming the data format, under any compression suffix (`a.jsonl.gz` -> `.jsonl`)."""
    suffixes = [x.lower() for x in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSED_SUFFIXES:
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def parse_json_line(line_bytes: bytes, name: str, lineno: int) -> dict | None:
    try:
        line = line_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = line_bytes[exc.start:exc.start + 1]
        raise DataError(name, lineno, f"not UTF-8 text (byte {bad!r} at column {exc.start + 1}); "
                                      "re-save the file as UTF-8") from None
    if not line.strip():
        return None
    try:
        record = json.loads(line, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as exc:
        raise DataError(name, lineno, f"malformed JSON: {exc.msg} at column {exc.colno}") from None
    except DuplicateKey as exc:
        raise DataError(name, lineno, exc.message()) from None
    except RecursionError:
        raise DataError(name, lineno, "JSON nested too deeply (objects or arrays hundreds of levels deep)") from None
    if not isinstance(record, dict):
        raise DataError(name, lineno, f"expected a JSON object {{...}}, found {json_kind(record)}")
    return record


def json_kind(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def refuse_duplicate_columns(name: str, columns: list[str], line: int | None) -> None:
    """Two columns of one name would become one field (pandas renames the second, Arrow keeps the last)."""
    twice = duplicate_column(columns)
    if twice is not None:
        raise DataError(name, line, f"the column {twice!r} appears twice in the header; rename or remove one")


def drop_missing(row: dict) -> dict:
    """Missing cells become absent fields, as in JSON lines; numpy scalars become Python ones."""
    out = {}
    for key, value in row.items():
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if type(value).__module__ == "numpy" and hasattr(value, "item"):
            value = value.item()
        out[key] = value
    return out


def sized(record: Record, name: str, limit: int, tolerant: bool, problem: str | None = None) -> Record | Problem:
    """A record a library parsed (CSV, Parquet, hub, pandas' JSON layouts) held to `limit` once built, as
    the whole-file reader held them: kept at its row; else (or with a `problem` already found) a Problem
    with `tolerant`, an error without."""
    size = record_size(record.data) if problem is None else 0
    if problem is None and size <= limit:
        return record
    error = record_error(name, record, problem or oversize(size, limit))
    if not tolerant:
        raise error
    return Problem(record.line, error.detail if record.line is not None else str(error))
