"""Dataset files (and hub datasets) to plain dict records, each tagged with where it came from.

JSONL and JSON are parsed here, line by line, so that every problem names
its line. CSV and Parquet go through pandas and pyarrow (the libraries
`datasets` itself uses) and name the row; hub datasets go through
`datasets.load_dataset`. Nothing here knows about formats: see `formats.py`.
Every record is held to `data.max_record_bytes` and to one value per key (`limits.py`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataError
from .limits import MAX_RECORD_BYTES, DuplicateKey, duplicate_column, line_spans, oversize, record_size, unique_keys

LOCAL_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".parquet")
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zip")
TEXT_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".tsv")


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


def read_source(path: Path, name: str, *, split: str = "train", subset: str | None = None,
                tolerant: bool = False, max_record_bytes: int = MAX_RECORD_BYTES) -> RawSource:
    """Read a local file by its suffix, or else the hub dataset called `name`."""
    if is_local(path):
        return read_file(path, name, tolerant, max_record_bytes)
    return check_sizes(read_hub(name, split, subset), max_record_bytes, tolerant)


def read_file(path: Path, display: str, tolerant: bool = False, max_record_bytes: int = MAX_RECORD_BYTES) -> RawSource:
    if not path.is_file():
        what = "is a directory, not a data file" if path.is_dir() else "file not found"
        raise DataError(display, None, f"{what} (looked at {path})")
    suffix = data_suffix(path)
    readers = {".jsonl": read_jsonl, ".ndjson": read_jsonl, ".json": read_json,
               ".csv": read_csv, ".tsv": read_csv, ".parquet": read_parquet}
    raw = decompress(path.read_bytes(), path, display)
    if path.suffix.lower() == ".zip":
        raw, suffix = unzip_one(raw, display)
    if suffix not in readers:
        raise DataError(display, None, f"unsupported file type {suffix or '(none)'!r}; use one of "
                                       f"{', '.join(LOCAL_SUFFIXES)}, each optionally compressed "
                                       f"({', '.join(COMPRESSED_SUFFIXES)})")
    if suffix in TEXT_SUFFIXES:
        raw = as_utf8_text(raw, display)
    if suffix in (".jsonl", ".ndjson", ".json"):     # measured while parsing, before each record is built
        source = readers[suffix](raw, display, tolerant, Path(f"data{suffix}"), max_record_bytes)
    else:
        source = check_sizes(readers[suffix](raw, display, tolerant, Path(f"data{suffix}")), max_record_bytes, tolerant)
    if not source.records and not source.problems:
        raise DataError(display, None, "the file holds no records")
    if not source.records:
        raise DataError(display, source.problems[0].line,
                        f"no usable records: all {len(source.problems)} were bad; the first: {source.problems[0].message}")
    return source


# --------------------------------------------------------------------------- as tools export them

# Compressed files misnamed without their suffix are recognised by these (binary) first bytes.
_MAGIC = {b"\x1f\x8b": ".gz", b"\xfd7zXZ\x00": ".xz", b"\x28\xb5\x2f\xfd": ".zst"}
_SUFFIX_KINDS = (".gz", ".bz2", ".xz", ".zst")


def decompress(raw: bytes, path: Path, display: str) -> bytes:
    """The file's bytes, decompressed when its suffix or its first bytes say gzip, bzip2, xz or zstd."""
    kind = path.suffix.lower()
    if kind not in _SUFFIX_KINDS:
        kind = next((k for magic, k in _MAGIC.items() if raw.startswith(magic)), None)
    if kind is None:
        return raw
    try:
        if kind == ".gz":
            import gzip
            return gzip.decompress(raw)
        if kind == ".bz2":
            import bz2
            return bz2.decompress(raw)
        if kind == ".xz":
            import lzma
            return lzma.decompress(raw)
        return _zstd_decompress(raw, display)
    except DataError:
        raise
    except Exception as exc:   # each library raises its own type for a damaged stream
        raise DataError(display, None, f"not a readable {kind[1:]} file ({exc}); is it complete?") from None


def _zstd_decompress(raw: bytes, display: str) -> bytes:
    try:
        import zstandard
    except ImportError:
        raise DataError(display, None, "reading zstd-compressed files needs the zstandard package: "
                                       "pip install zstandard (or decompress it: zstd -d FILE)") from None
    return zstandard.ZstdDecompressor().stream_reader(raw).read()


def unzip_one(raw: bytes, display: str) -> tuple[bytes, str]:
    """The one data file inside a .zip archive, and its suffix."""
    import io
    import zipfile

    try:
        archive = zipfile.ZipFile(io.BytesIO(raw))
    except zipfile.BadZipFile as exc:
        raise DataError(display, None, f"not a readable zip file ({exc})") from None
    members = [m for m in archive.namelist() if not m.endswith("/") and not m.startswith("__MACOSX/")]
    if len(members) != 1:
        raise DataError(display, None, f"a zip archive must hold exactly one data file; this one holds "
                                       f"{len(members)}: {', '.join(members[:5])}")
    return archive.read(members[0]), data_suffix(Path(members[0]))


def as_utf8_text(raw: bytes, display: str) -> bytes:
    """Text as Windows tools write it, made plain UTF-8 with LF line ends: a UTF-16 or UTF-32 file
    (found by its byte-order mark) is re-encoded, and a UTF-8 BOM, CRLF line ends and a trailing
    Ctrl-Z (the old end-of-file mark) are dropped. Line numbers are unchanged."""
    import codecs

    for bom, codec in ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
                       (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16")):
        if raw.startswith(bom):
            try:
                raw = raw.decode(codec).encode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(display, None, f"starts with a {codec.upper()} byte-order mark but is not valid "
                                               f"{codec.upper()} text at byte {exc.start}; re-save it as UTF-8") from None
            break
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
    raw = raw.replace(b"\r\n", b"\n").rstrip(b"\x1a")
    if b"\x00" in raw[:4096]:
        raise DataError(display, raw.count(b"\n", 0, raw.index(b"\x00")) + 1,
                        "holds NUL bytes: the file looks like UTF-16 text without a byte-order mark; re-save it as UTF-8")
    return raw


def check_sizes(source: RawSource, limit: int, tolerant: bool) -> RawSource:
    """Records a library parsed (CSV, Parquet, hub) held to `limit`, before any reaches the tokenizer."""
    kept = []
    for record in source.records:
        size = record_size(record.data)
        if size <= limit:
            kept.append(record)
            continue
        error = record_error(source.name, record, oversize(size, limit))
        if not tolerant:
            raise error
        source.problems.append(Problem(record.line, error.detail if record.line is not None else str(error)))
    source.records = kept
    return source


def fingerprint_bytes(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def find_bad_utf8(raw: bytes) -> tuple[int, str] | None:
    """(line, description) of the first byte that is not UTF-8, or None."""
    try:
        raw.decode("utf-8")
        return None
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - raw.rfind(b"\n", 0, exc.start)
        bad = raw[exc.start:exc.start + 1]
        return line, f"not UTF-8 text (byte {bad!r} at column {column}); re-save the file as UTF-8"


# --------------------------------------------------------------------------- JSON lines

def read_jsonl(raw: bytes, name: str, tolerant: bool, path: Path | None = None,
               limit: int = MAX_RECORD_BYTES) -> RawSource:
    """One JSON object per line; blank lines are skipped. A line's length is known before it is copied
    or parsed, so an oversized one costs a scan for its end and nothing more."""
    source = RawSource(name, [], fingerprint_bytes(raw))
    for lineno, start, end in line_spans(raw):
        try:
            if end - start > limit:
                raise DataError(name, lineno, oversize(end - start, limit, "this line"))
            record = parse_json_line(raw[start:end], name, lineno)
        except DataError as exc:
            if not tolerant:
                raise
            source.problems.append(Problem(lineno, exc.detail))
            continue
        if record is not None:
            source.records.append(Record(record, len(source.records) + 1, lineno))
    return source


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
        raise DataError(name, lineno, f"expected a JSON object {{...}}, found {_json_kind(record)}")
    return record


def _json_kind(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


# --------------------------------------------------------------------------- JSON

RECORD_LIST_KEYS = ("data", "rows", "records", "examples")


def read_json(raw: bytes, name: str, tolerant: bool, path: Path | None = None,
              limit: int = MAX_RECORD_BYTES) -> RawSource:
    """A JSON array of objects (each tagged with the line it starts on), an object holding
    one such array (`{"data": [...]}`, or beside other keys under data/rows/records/examples),
    pandas' `to_json` layouts (split, columns), or JSON lines saved with a .json suffix."""
    bad = find_bad_utf8(raw)
    if bad:
        raise DataError(name, *bad)
    text = raw.decode("utf-8")
    start = _skip_ws(text, 0)
    if start == len(text):
        raise DataError(name, None, "the file holds no records")
    if text[start] == "[":
        return _read_json_array(text, start, name, fingerprint_bytes(raw), tolerant, limit)
    duplicate = None
    try:
        whole = json.loads(text, object_pairs_hook=unique_keys)
    except DuplicateKey as exc:
        # Read again to find the records; each is checked again below, naming its line.
        duplicate, whole = DataError(name, None, exc.message()), json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return read_jsonl(raw, name, tolerant, limit=limit)     # JSON lines under a .json name
    if not isinstance(whole, dict):
        return read_jsonl(raw, name, tolerant, limit=limit)
    table = _pandas_layout(whole)
    if table is not None:
        if duplicate is not None:
            raise duplicate
        source = RawSource(name, [Record(r, i + 1) for i, r in enumerate(table)], fingerprint_bytes(raw))
        return check_sizes(source, limit, tolerant)
    key = _record_list_key(whole)
    if key is None:
        return read_jsonl(raw, name, tolerant, limit=limit)     # a single object: one JSON line
    source = _read_json_array(text, _value_start(text, start, key), name, fingerprint_bytes(raw), tolerant, limit)
    if duplicate is not None:          # outside the records: in the object that holds them
        raise duplicate
    return source


def _value_start(text: str, pos: int, key: str) -> int:
    """Where the value of the top-level `key` starts in the JSON object at `pos` (a valid one)."""
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, pos + 1)
    while True:
        name, pos = decoder.raw_decode(text, pos)
        pos = _skip_ws(text, _skip_ws(text, pos) + 1)        # past the ':'
        if name == key:
            return pos
        _, pos = decoder.raw_decode(text, pos)
        pos = _skip_ws(text, _skip_ws(text, pos) + 1)        # past the ','


def _record_list_key(whole: dict) -> str | None:
    """The key holding the records: the object's only key with a list, or data/rows/records/examples."""
    lists = [k for k, v in whole.items() if isinstance(v, list)]
    if len(whole) == 1 and len(lists) == 1:
        return lists[0]
    named = [k for k in RECORD_LIST_KEYS if isinstance(whole.get(k), list)
             and all(isinstance(r, dict) for r in whole[k])]
    return named[0] if named else None


def _pandas_layout(whole: dict) -> list[dict] | None:
    """Rows of a DataFrame written by pandas' to_json as orient='split' or the default 'columns'."""
    if set(whole) in ({"columns", "data"}, {"columns", "index", "data"}) and isinstance(whole["columns"], list) \
            and isinstance(whole["data"], list) and all(isinstance(r, list) for r in whole["data"]):
        return [_drop_missing(dict(zip(whole["columns"], row))) for row in whole["data"]]
    columns = list(whole.values())
    if columns and all(isinstance(c, dict) and c for c in columns):
        index = list(columns[0])
        if all(k.isdigit() for k in index) and all(list(c) == index for c in columns):
            return [_drop_missing({col: whole[col][i] for col in whole}) for i in index]
    return None


def _read_json_array(text: str, pos: int, name: str, fingerprint: str, tolerant: bool,
                     limit: int = MAX_RECORD_BYTES) -> RawSource:
    decoder = json.JSONDecoder(object_pairs_hook=unique_keys)
    source = RawSource(name, [], fingerprint)
    pos = _skip_ws(text, pos + 1)
    line, counted = 1, 0
    while pos < len(text) and text[pos] != "]":
        line, counted = line + text.count("\n", counted, pos), pos      # counted once, not from the top
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise DataError(name, exc.lineno, f"malformed JSON: {exc.msg} at column {exc.colno}") from None
        except RecursionError:
            raise DataError(name, line, "JSON nested too deeply (objects or arrays hundreds of levels deep)") from None
        except DuplicateKey as exc:
            value, end, problem = None, _end_of_value(text, pos), exc.message()
        else:
            problem = None if isinstance(value, dict) else f"expected a JSON object {{...}}, found {_json_kind(value)}"
        size = end - pos if end - pos > limit // 4 else 0      # characters; bytes measured only near the limit
        if size and len(text[pos:end].encode("utf-8")) > limit:
            problem = oversize(len(text[pos:end].encode("utf-8")), limit)
        if problem is None:
            source.records.append(Record(value, len(source.records) + 1, line))
        elif tolerant:
            source.problems.append(Problem(line, problem))
        else:
            raise DataError(name, line, problem)
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
        elif pos < len(text) and text[pos] != "]":
            line = text.count("\n", 0, pos) + 1
            raise DataError(name, line, f"malformed JSON: expected ',' or ']' between records, found {text[pos]!r}")
    if pos >= len(text):
        raise DataError(name, text.count("\n") + 1, "malformed JSON: the array is never closed with ']'")
    return source


def _end_of_value(text: str, pos: int) -> int:
    """Where the JSON value at `pos` ends, read without the duplicate-key check (to skip past it)."""
    return json.JSONDecoder().raw_decode(text, pos)[1]


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


# --------------------------------------------------------------------------- tables

def read_csv(raw: bytes, name: str, tolerant: bool, path: Path) -> RawSource:
    """A header row, then one record per row, each tagged with the line it starts on."""
    import csv
    import io

    import pandas as pd

    bad = find_bad_utf8(raw)
    if bad:
        raise DataError(name, *bad)
    sep = "\t" if path.suffix.lower() == ".tsv" else ","
    try:
        # Only empty cells are missing: a text "NA" or "null" stays text.
        frame = pd.read_csv(io.BytesIO(raw), sep=sep, keep_default_na=False, na_values=[""],
                            dtype_backend="numpy_nullable")
    except pd.errors.EmptyDataError:
        raise DataError(name, None, "the file holds no records") from None
    except pd.errors.ParserError as exc:
        raise DataError(name, None, f"malformed CSV: {exc}") from None
    frame = frame.astype(object).where(frame.notna(), None)
    text = raw.decode("utf-8")
    header = next((row for row in csv.reader(io.StringIO(text), delimiter=sep) if row), [])
    _refuse_duplicate_columns(name, header, None)
    lines = _csv_row_lines(text, sep)
    records = [Record(_drop_missing(r), i + 1, lines[i] if i < len(lines) else None)
               for i, r in enumerate(frame.to_dict("records"))]
    return RawSource(name, records, fingerprint_bytes(raw))


def _csv_row_lines(text: str, sep: str) -> list[int]:
    """The line each data row starts on (quoted cells may span lines); blank lines hold no row."""
    import csv

    reader = csv.reader(text.splitlines(keepends=True), delimiter=sep)
    starts, consumed = [], 0
    for row in reader:
        if row and consumed > 0:
            starts.append(consumed + 1)
        consumed = reader.line_num
    return starts


def read_parquet(raw: bytes, name: str, tolerant: bool, path: Path) -> RawSource:
    import io

    import pyarrow.parquet as pq

    try:
        table = pq.read_table(io.BytesIO(raw))
    except Exception as exc:   # pyarrow raises several unrelated types for a bad file
        raise DataError(name, None, f"not a readable Parquet file ({exc})") from None
    _refuse_duplicate_columns(name, table.column_names, None)
    records = [Record(_drop_missing(r), i + 1) for i, r in enumerate(table.to_pylist())]
    return RawSource(name, records, fingerprint_bytes(raw))


def _refuse_duplicate_columns(name: str, columns: list[str], line: int | None) -> None:
    """Two columns of one name would become one field (pandas renames the second, Arrow keeps the last)."""
    twice = duplicate_column(columns)
    if twice is not None:
        raise DataError(name, line, f"the column {twice!r} appears twice in the header; rename or remove one")


def _drop_missing(row: dict) -> dict:
    """Missing cells become absent fields, as in JSON lines; numpy scalars become Python ones."""
    out = {}
    for key, value in row.items():
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if type(value).__module__ == "numpy" and hasattr(value, "item"):
            value = value.item()
        out[key] = value
    return out


# --------------------------------------------------------------------------- hub

def read_hub(name: str, split: str, subset: str | None) -> RawSource:
    """A dataset from the Hugging Face Hub (or the local `datasets` cache when offline)."""
    try:
        import datasets
    except ImportError:
        raise DataError(name, None, "reading hub datasets needs the `datasets` package: pip install datasets") from None
    try:
        ds = datasets.load_dataset(name, subset, split=split)
    except Exception as exc:   # network, missing dataset, bad split: all one message for the user
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(name, None, f"no local file by this name, and loading it as a hub dataset failed: {reason}") from None
    records = [Record(_drop_missing(r), i + 1) for i, r in enumerate(ds)]
    if not records:
        raise DataError(name, None, f"split {split!r} holds no records")
    fingerprint = hashlib.sha256(f"{name}|{subset}|{split}|{ds._fingerprint}".encode()).hexdigest()
    return RawSource(name, records, fingerprint)
