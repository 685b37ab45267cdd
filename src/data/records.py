"""Read dataset files into plain records, naming file and line for every problem."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import DataError

# format name -> the keys that identify it
FORMAT_KEYS: dict[str, tuple[str, ...]] = {
    "chat": ("messages",),
    "text": ("text",),
}


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) pairs; blank lines are skipped, anything else must be a JSON object."""
    if not path.is_file():
        raise DataError(str(path), None, "file not found")
    out = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(str(path), lineno, f"not UTF-8 text (byte {exc.start}: {raw[exc.start:exc.start+1]!r})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(str(path), lineno, f"malformed JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(record, dict):
                raise DataError(str(path), lineno, f"expected a JSON object, found {type(record).__name__}")
            out.append((lineno, record))
    if not out:
        raise DataError(str(path), None, "the file holds no records")
    return out


def detect_format(path: Path, records: list[tuple[int, dict]]) -> str:
    """The one format every record matches; a file mixing formats is an error."""
    seen: dict[str, int] = {}
    for lineno, record in records:
        fmt = next((name for name, keys in FORMAT_KEYS.items() if all(k in record for k in keys)), None)
        if fmt is None:
            expected = " or ".join("{" + ", ".join(repr(k) for k in keys) + "}" for keys in FORMAT_KEYS.values())
            raise DataError(str(path), lineno, f"expected a record with {expected}; found keys {sorted(record)}")
        seen.setdefault(fmt, lineno)
    if len(seen) > 1:
        parts = ", ".join(f"{fmt} (first at line {line})" for fmt, line in seen.items())
        raise DataError(str(path), None, f"the file mixes formats: {parts}; use one format per file")
    return next(iter(seen))


def check_record(path: Path, lineno: int, fmt: str, record: dict) -> None:
    if fmt == "text":
        if not isinstance(record["text"], str):
            raise DataError(str(path), lineno, f"'text' must be a string, found {type(record['text']).__name__}")
        return
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(str(path), lineno, "'messages' must be a non-empty list of {'role', 'content'} objects")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise DataError(str(path), lineno, f"messages[{i}] must be an object with string 'role' and 'content', found {msg!r:.80}")
        if msg["role"] not in ("system", "user", "assistant", "tool"):
            raise DataError(str(path), lineno, f"messages[{i}].role {msg['role']!r} is not one of system, user, assistant, tool")


def load_records(path: Path) -> tuple[str, list[tuple[int, dict]]]:
    records = read_jsonl(path)
    fmt = detect_format(path, records)
    for lineno, record in records:
        check_record(path, lineno, fmt, record)
    return fmt, records
