"""A dataset's records, read one at a time from any file format or the hub: the dispatch, and the
whole-source read (`read_source`) for the methods that keep every record.

Memory is bounded by the largest record, not the file: text comes through text_source.py a block at a
time, JSON through stream_json.py, CSV and Parquet through stream_tables.py, hub datasets through
stream_hub.py. Messages name the file and line (or row) as the whole-file readers did.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

from ..errors import DataError
from .limits import MAX_RECORD_BYTES
from .readers import COMPRESSED_SUFFIXES, LOCAL_SUFFIXES, Problem, RawSource, Record, is_local
from .stream_hub import hub_records
from .stream_json import json_records, line_records, text_lines
from .stream_tables import csv_records, parquet_records
from .text_source import compression, content_suffix, first_bad_utf8, open_content, text_blocks


def local_format(path: Path, display: str) -> str:
    """The format suffix of a local data file; a missing file or an unknown suffix is an error."""
    if not path.is_file():
        what = "is a directory, not a data file" if path.is_dir() else "file not found"
        raise DataError(display, None, f"{what} (looked at {path})")
    suffix = content_suffix(path, display)
    if suffix not in LOCAL_SUFFIXES:
        raise DataError(display, None, f"unsupported file type {suffix or '(none)'!r}; use one of "
                                       f"{', '.join(LOCAL_SUFFIXES)}, each optionally compressed "
                                       f"({', '.join(COMPRESSED_SUFFIXES)})")
    return suffix


def file_records(path: Path, display: str, tolerant: bool, limit: int, digest=None) -> Iterator[Record | Problem]:
    """A local file's records (and, with `tolerant`, problems), in file order; `digest` is fed the
    file's content (decompressed; text as plain UTF-8), which is what fingerprints it."""
    suffix = local_format(path, display)
    if suffix == ".parquet":
        with open_content(path, display) as stream:
            seekable = compression(path) is None and path.suffix.lower() != ".zip"
            yield from parquet_records(stream, seekable, display, tolerant, limit, digest)
        return

    def blocks(hashed: bool):
        return text_blocks(path, display, digest if hashed else None)

    if suffix in (".jsonl", ".ndjson"):        # each line is checked for UTF-8 as it is parsed
        yield from line_records(text_lines(blocks(True), limit), display, tolerant, limit)
        return
    bad = first_bad_utf8(blocks(False))
    if bad is not None:
        raise DataError(display, *bad)
    if suffix == ".json":
        yield from json_records(blocks, display, tolerant, limit)
    else:
        yield from csv_records(blocks, display, "\t" if suffix == ".tsv" else ",", tolerant, limit)


def source_records(path: Path, display: str, tolerant: bool, limit: int, digest=None,
                   spec=None) -> Iterator[Record | Problem]:
    """A local file's records, or (not a local file) those of the hub dataset `display` names, read as
    `spec` says (split, subset, streaming)."""
    if is_local(path):
        return file_records(path, display, tolerant, limit, digest)
    return hub_records(display, getattr(spec, "split", "train"), getattr(spec, "subset", None),
                       getattr(spec, "streaming", False), tolerant, limit, digest)


def read_source(path: Path, name: str, *, split: str = "train", subset: str | None = None,
                tolerant: bool = False, max_record_bytes: int = MAX_RECORD_BYTES,
                streaming: bool = False) -> RawSource:
    """Every record of a local file (by its suffix), or else of the hub dataset called `name`."""
    if is_local(path):
        return read_file(path, name, tolerant, max_record_bytes)
    digest = hashlib.sha256()
    return _collect(name, hub_records(name, split, subset, streaming, tolerant, max_record_bytes, digest), digest)


def read_file(path: Path, display: str, tolerant: bool = False, max_record_bytes: int = MAX_RECORD_BYTES) -> RawSource:
    digest = hashlib.sha256()
    source = _collect(display, file_records(path, display, tolerant, max_record_bytes, digest), digest)
    if not source.records and not source.problems:
        raise DataError(display, None, "the file holds no records")
    if not source.records:
        raise DataError(display, source.problems[0].line,
                        f"no usable records: all {len(source.problems)} were bad; the first: {source.problems[0].message}")
    return source


def _collect(name: str, items: Iterator[Record | Problem], digest) -> RawSource:
    source = RawSource(name, [], "")
    for item in items:
        (source.records if isinstance(item, Record) else source.problems).append(item)
    source.fingerprint = digest.hexdigest()
    return source
