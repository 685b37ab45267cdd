"""What a single record may be: at most `data.max_record_bytes` large, and no key twice in one object.

Both are checked while a file is read, before a record reaches the tokenizer. A JSON line is measured
before it is parsed: a 200 MB line used to take 17 GB on its way through parsing and tokenizing, and is
now refused after one scan for its end. Records that a library parses for us (JSON arrays, CSV, Parquet,
hub datasets) are measured as soon as each one exists. A key given twice in one JSON object is an
error: Python's json keeps the last one, so a record with two "messages" trained silently on the second.
"""

from __future__ import annotations

from ..config.data import MAX_RECORD_BYTES


class DuplicateKey(ValueError):
    """Raised from inside json decoding by `unique_keys`; the reader adds file and line."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key

    def message(self) -> str:
        shown = self.key if len(self.key) <= 60 else self.key[:60] + "..."
        return (f"the key {shown!r} appears twice in one JSON object (JSON readers keep only the last, so "
                "one of them would be lost); keep one")


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json's object_pairs_hook: the object as a dict, or DuplicateKey for a key given twice."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return obj


def duplicate_column(columns: list[str]) -> str | None:
    """The first column name that appears twice, or None."""
    seen: set[str] = set()
    for column in columns:
        if column in seen:
            return column
        seen.add(column)
    return None


def line_spans(raw: bytes):
    """(line number, start, end) of each line of `raw`, without copying any."""
    start, lineno = 0, 1
    while start <= len(raw):
        end = raw.find(b"\n", start)
        end = len(raw) if end < 0 else end
        yield lineno, start, end
        start, lineno = end + 1, lineno + 1


def oversize(size: int, limit: int, what: str = "this record") -> str:
    return (f"{what} is {size:,} bytes, over data.max_record_bytes ({limit:,}); split it into smaller "
            "records, or raise data.max_record_bytes if it is meant to be this large")


def record_size(data) -> int:
    """About the bytes `data` takes as text: every string's and key's length, 8 for any other value.
    Walked with a stack (a deeply nested record costs no recursion), and stopped counting nowhere: the
    cost is one pass over what the record holds, which its reader has already built."""
    size, stack = 0, [data]
    while stack:
        value = stack.pop()
        if isinstance(value, str | bytes):
            size += len(value)
        elif isinstance(value, dict):
            size += sum(len(k) if isinstance(k, str) else 8 for k in value)
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
        else:
            size += 8
    return size


__all__ = ["MAX_RECORD_BYTES", "DuplicateKey", "unique_keys", "duplicate_column", "line_spans", "oversize",
           "record_size"]
