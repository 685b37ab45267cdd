"""CSV/TSV and Parquet files read a few rows at a time.

CSV goes through pandas (the library `datasets` itself uses) in chunks of ROWS rows. pandas decides each
column's type from its values: read whole, a column of 1 and 2.5 is floats, one of 1 and "yes" is text.
Chunk by chunk, it would decide per chunk; so a first pass reads every chunk and notes the types it found
per column, and the second reads with the combined type given. Each row is tagged with the line it starts
on by the csv module reading the same text beside it (a quoted cell may span lines). Parquet is read by
row group, ROWS rows at a time, with pyarrow.
"""

from __future__ import annotations

import contextlib
import csv
import io
import tempfile
from collections.abc import Iterator

from ..errors import DataError
from .readers import Problem, Record, drop_missing, refuse_duplicate_columns, sized
from .text_source import BLOCK

ROWS = 256          # rows parsed at a time
_NUMBERS = ("Int64", "UInt64", "Float64")


class BlockReader(io.RawIOBase):
    """A binary stream over an iterator of blocks (what pandas and pyarrow read from)."""

    def __init__(self, blocks: Iterator[bytes]):
        self._blocks, self._view = iter(blocks), memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, into) -> int:
        while not len(self._view):
            block = next(self._blocks, None)
            if block is None:
                return 0
            self._view = memoryview(block)
        n = min(len(into), len(self._view))
        into[:n] = self._view[:n]
        self._view = self._view[n:]
        return n

    def close(self) -> None:
        close = getattr(self._blocks, "close", None)
        if close is not None:
            close()
        super().close()


# --------------------------------------------------------------------------- CSV

def csv_records(blocks, name: str, sep: str, tolerant: bool, limit: int) -> Iterator[Record | Problem]:
    """Records of CSV text (`blocks(hashed)` opens it afresh; the hashed reading fingerprints the file),
    each tagged with the line it starts on. The text is known to be UTF-8 (sources.py checked it)."""
    dtypes = _column_types(blocks, name, sep)
    _refuse_duplicate_header(blocks(False), name, sep)
    lines = _row_lines(blocks(False), sep)
    row = 0
    with BlockReader(blocks(True)) as text:
        for chunk in _chunks(text, sep, dtypes):
            for values in chunk.astype(object).where(chunk.notna(), None).to_dict("records"):
                row += 1
                yield sized(Record(drop_missing(values), row, next(lines, None)), name, limit, tolerant)
    lines.close()


def _chunks(text, sep: str, dtypes: dict | None = None):
    import pandas as pd

    # Only empty cells are missing: a text "NA" or "null" stays text.
    return pd.read_csv(text, sep=sep, keep_default_na=False, na_values=[""], dtype_backend="numpy_nullable",
                       dtype=dtypes, chunksize=ROWS)


def _column_types(blocks, name: str, sep: str) -> dict:
    """The type pandas gives each column when it reads the whole file: per chunk's types combined."""
    import pandas as pd

    seen: dict[str, list] = {}
    try:
        with BlockReader(blocks(False)) as text:
            for chunk in _chunks(text, sep):
                for column, dtype in chunk.dtypes.items():
                    kinds = seen.setdefault(column, [])
                    if chunk[column].notna().any() and dtype not in kinds:
                        kinds.append(dtype)
    except pd.errors.EmptyDataError:
        raise DataError(name, None, "the file holds no records") from None
    except pd.errors.ParserError as exc:
        raise DataError(name, None, f"malformed CSV: {exc}") from None
    return {column: _combined(kinds) for column, kinds in seen.items() if kinds}


def _combined(kinds: list):
    """One column's type from its chunks' types, as pandas decides it over all the values at once."""
    if len(kinds) == 1:
        return kinds[0]
    names = {str(k) for k in kinds}
    if names <= set(_NUMBERS):
        return next(k for k in kinds if str(k) == ("Float64" if "Float64" in names else "UInt64"))
    return next((k for k in kinds if str(k) not in (*_NUMBERS, "boolean")), object)


def _refuse_duplicate_header(blocks, name: str, sep: str) -> None:
    """Two columns of one name would become one field (pandas renames the second)."""
    try:
        header = next((row for row in csv.reader(_text_lines(blocks), delimiter=sep) if row), [])
    finally:
        blocks.close()
    refuse_duplicate_columns(name, header, None)


def _row_lines(blocks, sep: str) -> Iterator[int]:
    """The line each data row starts on (quoted cells may span lines); blank lines hold no row. Lines are
    counted as str.splitlines counts them, as the whole-file reader did."""
    reader = csv.reader(_text_lines(blocks), delimiter=sep)
    consumed = 0
    try:
        for row in reader:
            if row and consumed > 0:
                yield consumed + 1
            consumed = reader.line_num
    finally:
        blocks.close()


_LINE_ENDS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"      # where str.splitlines ends a line


def _text_lines(blocks) -> Iterator[str]:
    """The UTF-8 text's lines, with their ends (str.splitlines' line ends; CRLF is already LF). A line longer
    than a block is gathered in pieces, joined once."""
    import codecs

    decoder, parts = codecs.getincrementaldecoder("utf-8")(), []
    for block in blocks:
        for piece in decoder.decode(block).splitlines(keepends=True):
            parts.append(piece)
            if piece[-1] in _LINE_ENDS:
                yield "".join(parts)
                parts = []
    if parts:
        yield "".join(parts)


# --------------------------------------------------------------------------- Parquet

def parquet_records(stream, seekable: bool, name: str, tolerant: bool, limit: int,
                    digest=None) -> Iterator[Record | Problem]:
    """Records of a Parquet file, by row group. A file read out of an archive (not seekable) is first
    copied to a temporary file, a block at a time: Parquet is read from its end."""
    with tempfile.TemporaryFile() if not seekable else contextlib.nullcontext() as spool:
        if spool is not None:
            _copy(stream, spool, digest)
            stream = spool
        elif digest is not None:
            _copy(stream, None, digest)
        yield from _parquet_rows(stream, name, tolerant, limit)


def _copy(stream, into, digest) -> None:
    """The stream's bytes into `into` (or only hashed), and the stream rewound or `into` at its start."""
    while block := stream.read(BLOCK):
        if digest is not None:
            digest.update(block)
        if into is not None:
            into.write(block)
    (into or stream).seek(0)


def _parquet_rows(stream, name: str, tolerant: bool, limit: int) -> Iterator[Record | Problem]:
    import pyarrow.parquet as pq

    try:
        # Without pre-buffering and threads a row group's columns are read a page at a time, one after another:
        # measured flat (106 MB peak) from 8 to 23 MB of Parquet, where the defaults grew 125 -> 162 MB.
        table = pq.ParquetFile(stream, pre_buffer=False, buffer_size=BLOCK)
        columns = table.schema_arrow.names
    except Exception as exc:   # pyarrow raises several unrelated types for a bad file
        raise DataError(name, None, f"not a readable Parquet file ({exc})") from None
    refuse_duplicate_columns(name, columns, None)
    row = 0
    try:
        for batch in table.iter_batches(batch_size=ROWS, use_threads=False):
            for values in batch.to_pylist():
                row += 1
                yield sized(Record(drop_missing(values), row), name, limit, tolerant)
    except OSError as exc:     # a damaged row group, found when it is read
        raise DataError(name, None, f"not a readable Parquet file ({exc})") from None


__all__ = ["BlockReader", "csv_records", "parquet_records", "ROWS"]
