"""JSON files read record by record: a top-level array, an object holding one (`{"data": [...]}`, or beside
other keys under data/rows/records/examples), pandas' to_json layouts, and JSON lines (under any suffix).

An array's records are found by json_window's scanner and parsed one at a time, each tagged with the line
it starts on; a record over `data.max_record_bytes` is measured, not held. An object is first surveyed
(every value parsed once, nothing kept but what decides the layout, as the whole-file reader decided it
from the parsed document), then read again for its records. The messages and the lines they name are the
whole-file reader's. Only pandas' column-major layout (its to_json default) is read whole: each row takes a
value from every column.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..errors import DataError
from .json_window import Window
from .limits import DuplicateKey, oversize, unique_keys
from .readers import Problem, Record, drop_missing, json_kind, parse_json_line, sized
from .text_source import not_utf8

RECORD_LIST_KEYS = ("data", "rows", "records", "examples")
_CHECKED = json.JSONDecoder(object_pairs_hook=unique_keys)
_PLAIN = json.JSONDecoder()
_UNLIMITED = 1 << 62


def json_records(blocks, name: str, tolerant: bool, limit: int) -> Iterator[Record | Problem]:
    """Records of a .json file's text; `blocks()` opens the text afresh (an object is read twice) and
    `blocks(True)` is the reading whose bytes are the file's fingerprint."""
    first = _first_byte(blocks(False))
    if first is None:
        raise DataError(name, None, "the file holds no records")
    if first == ord("["):
        win = Window(blocks(True))
        win.skip_ws()
        yield from array_records(win, name, tolerant, limit)
        win.drain()
        return
    survey = _survey(blocks(False), name, limit) if first == ord("{") else None
    if survey is None:                                  # not one JSON object: JSON lines under a .json name
        yield from line_records(text_lines(blocks(True), limit), name, tolerant, limit)
        return
    yield from _object_records(survey, blocks, name, tolerant, limit)


def _first_byte(blocks) -> int | None:
    try:
        win = Window(blocks)
        return win.skip_ws()
    finally:
        blocks.close()


# --------------------------------------------------------------------------- arrays

def array_records(win: Window, name: str, tolerant: bool, limit: int,
                  columns: list | None = None) -> Iterator[Record | Problem]:
    """The elements of the array at win.pos as records, each tagged with the line it starts on; with
    `columns` (pandas' split layout), each element a row of values, numbered by row."""
    win.pos += 1
    row, c = 0, win.skip_ws()
    while c is not None and c != ord("]"):
        line, cols = win.line_at(win.pos), win.column_at(win.pos)
        value, problem = _element(win, name, line, cols, limit, list if columns is not None else dict)
        if columns is not None:
            row += 1
            yield _row(value, problem, row, columns, name, tolerant, limit)
        elif problem is None:
            row += 1
            yield Record(value, row, line)
        elif tolerant:
            yield Problem(line, problem)
        else:
            raise DataError(name, line, problem)
        c = win.skip_ws()
        if c == ord(","):
            win.pos += 1
            c = win.skip_ws()
        elif c is not None and c != ord("]"):
            raise _between(win, name)
    if c is None:
        raise DataError(name, win.line_at(len(win.buf)), "malformed JSON: the array is never closed with ']'")
    win.pos += 1


def _row(values, problem, row: int, columns: list, name: str, tolerant: bool, limit: int):
    """A row of pandas' split layout as the whole-file reader made it: a record measured once built."""
    if problem is None:
        return sized(Record(drop_missing(dict(zip(columns, values))), row), name, limit, tolerant)
    return sized(Record({}, row), name, limit, tolerant, problem)


def _element(win: Window, name: str, line: int, cols: tuple[int, int], limit: int, kind: type = dict):
    """(value, None) for an object (or `kind`), or (None, what is wrong) for a record kept out;
    malformed JSON raises."""
    base, size, held = win.scan_value(limit)
    if not held:
        return None, oversize(size, limit)
    data = win.buf[base:base + size]
    value, used, duplicate = parse_value(data, name, line, cols)
    if used < size:
        win.pos = base + used            # what follows the value is checked as the array's next character
    if duplicate is not None:
        return None, duplicate.message()
    if isinstance(value, kind):
        return value, None
    return None, f"expected a JSON object {{...}}, found {json_kind(value)}"


def parse_value(data: bytes, name: str, line: int, cols: tuple[int, int]):
    """(value, bytes it took, DuplicateKey or None) of the JSON text `data` found at `line` after `cols`
    (characters, bytes) on it; bad UTF-8 and malformed JSON raise, named as in the whole file."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(name, *not_utf8(data, exc.start, line, cols[1])) from None
    try:
        value, end = _CHECKED.raw_decode(text)
        duplicate = None
    except json.JSONDecodeError as exc:
        column = exc.colno + (cols[0] if exc.lineno == 1 else 0)
        raise DataError(name, line + exc.lineno - 1, f"malformed JSON: {exc.msg} at column {column}") from None
    except RecursionError:
        raise DataError(name, line, "JSON nested too deeply (objects or arrays hundreds of levels deep)") from None
    except DuplicateKey as exc:
        value, end = _PLAIN.raw_decode(text)
        duplicate = exc
    used = len(data) if end == len(text) else len(text[:end].encode("utf-8"))
    return value, used, duplicate


def _between(win: Window, name: str) -> DataError:
    line, cols = win.line_at(win.pos), win.column_at(win.pos)
    head = win.buf[win.pos:win.pos + 4]
    for n in range(1, len(head) + 1):          # the one character found there, or the byte that is not UTF-8
        try:
            found = head[:n].decode("utf-8")
            break
        except UnicodeDecodeError as exc:
            if exc.reason != "unexpected end of data":
                return DataError(name, *not_utf8(head, 0, line, cols[1]))
    else:
        return DataError(name, *not_utf8(head, 0, line, cols[1]))
    return DataError(name, line, f"malformed JSON: expected ',' or ']' between records, found {found!r}")


# --------------------------------------------------------------------------- objects

@dataclass
class _Value:
    kind: str                        # "list", "dict" or "other"
    all_dicts: bool = True           # lists: every element an object
    all_lists: bool = True           # lists: every element an array
    keys: tuple | None = None        # dicts: their keys, in order


@dataclass
class _Survey:
    values: dict[str, _Value] = field(default_factory=dict)
    duplicate: str | None = None     # the first key given twice, as json.loads with the check would raise it


def _survey(blocks, name: str, limit: int) -> _Survey | None:
    """What decides an object's layout, read in one pass; None when the text is not one JSON object."""
    win = Window(blocks)
    try:
        win.skip_ws()
        return _walk_object(win, name, limit)
    except _NotOneObject:
        return None
    except DataError as exc:
        if exc.detail.startswith("not UTF-8"):    # found before anything else, as in the whole file
            raise
        return None                               # malformed: JSON lines under a .json name
    finally:
        blocks.close()


class _NotOneObject(ValueError):
    pass


def _fail():
    raise _NotOneObject()


def _walk_object(win: Window, name: str, limit: int) -> _Survey | None:
    survey, seen, top_duplicate = _Survey(), set(), None
    win.pos += 1
    c = win.skip_ws()
    while c != ord("}"):
        key = _decode(win, name, _UNLIMITED) if c == ord('"') else _fail()
        if key in seen and top_duplicate is None:
            top_duplicate = DuplicateKey(key).message()
        seen.add(key)
        _expect(win, b":")
        if win.skip_ws() is None:
            _fail()
        survey.values[key] = _walk_value(win, name, limit, survey)
        c = _next(win, b"}")
    win.pos += 1
    if win.skip_ws() is not None:                  # more after the object: JSON lines under a .json name
        return None
    survey.duplicate = survey.duplicate or top_duplicate
    return survey


def _next(win: Window, close: bytes) -> int:
    """Past the ',' after a value: the next non-space byte; or the closing `close` (not passed)."""
    c = win.skip_ws()
    if c == ord(","):
        win.pos += 1
        return win.skip_ws()
    if c != close[0]:
        _fail()
    return c


def _walk_value(win: Window, name: str, limit: int, survey: _Survey) -> _Value:
    if win.buf[win.pos] != ord("["):
        value = _decode(win, name, _UNLIMITED, survey)
        return _Value("dict", keys=tuple(value)) if isinstance(value, dict) else _Value("other")
    win.pos += 1
    out, c = _Value("list"), win.skip_ws()
    while c != ord("]"):
        if c is None:
            _fail()
        out.all_dicts &= c == ord("{")
        out.all_lists &= c == ord("[")
        _decode(win, name, limit, survey)
        c = _next(win, b"]")
    win.pos += 1
    return out


def _decode(win: Window, name: str, limit: int, survey: _Survey | None = None):
    """The JSON value at win.pos, parsed (None when over `limit`: only its brackets are checked); the first
    duplicate key inside it is noted in `survey`."""
    line, cols = win.line_at(win.pos), win.column_at(win.pos)
    base, size, held = win.scan_value(limit)
    if not held:
        return None
    value, used, duplicate = parse_value(win.buf[base:base + size], name, line, cols)
    if used < size:
        _fail()
    if duplicate is not None and survey is not None and survey.duplicate is None:
        survey.duplicate = duplicate.message()
    return value


def _expect(win: Window, char: bytes) -> None:
    if win.skip_ws() != char[0]:
        _fail()
    win.pos += 1


def _object_records(survey: _Survey, blocks, name: str, tolerant: bool, limit: int):
    values = survey.values
    duplicate = DataError(name, None, survey.duplicate) if survey.duplicate else None
    columns = values.get("columns")
    if set(values) in ({"columns", "data"}, {"columns", "index", "data"}) and columns.kind == "list" \
            and values["data"].kind == "list" and values["data"].all_lists:
        if duplicate is not None:
            raise duplicate
        yield from _records_under(blocks, "data", name, tolerant, limit, columns=_columns(blocks))
        return
    if _column_major(values):
        if duplicate is not None:
            raise duplicate
        for record in _read_column_major(blocks):
            yield sized(record, name, limit, tolerant)
        return
    key = _record_list_key(values)
    if key is None:
        yield from line_records(text_lines(blocks(True), limit), name, tolerant, limit)   # one JSON line
        return
    yield from _records_under(blocks, key, name, tolerant, limit)
    if duplicate is not None:          # outside the records: in the object that holds them
        raise duplicate


def _record_list_key(values: dict[str, _Value]) -> str | None:
    """The key holding the records: the object's only key with a list, or data/rows/records/examples."""
    lists = [k for k, v in values.items() if v.kind == "list"]
    if len(values) == 1 and len(lists) == 1:
        return lists[0]
    named = [k for k in RECORD_LIST_KEYS if k in values and values[k].kind == "list" and values[k].all_dicts]
    return named[0] if named else None


def _column_major(values: dict[str, _Value]) -> bool:
    """pandas' default to_json layout: every value an object keyed by the same row numbers."""
    columns = list(values.values())
    if not columns or not all(c.kind == "dict" and c.keys for c in columns):
        return False
    index = columns[0].keys
    return all(k.isdigit() for k in index) and all(c.keys == index for c in columns)


def _columns(blocks) -> list:
    """The `columns` list of pandas' split layout, read on its own (it may follow the rows)."""
    text = blocks(False)
    try:
        win = Window(text)
        win.skip_ws()
        _to_key(win, "columns")
        return _decode(win, "", _UNLIMITED)
    finally:
        text.close()


def _read_column_major(blocks) -> Iterator[Record]:
    text = b"".join(blocks(True)).decode("utf-8")
    whole = json.loads(text)
    index = list(next(iter(whole.values())))
    for i, key in enumerate(index):
        yield Record(drop_missing({col: whole[col][key] for col in whole}), i + 1)


def _records_under(blocks, key: str, name: str, tolerant: bool, limit: int, columns: list | None = None):
    """The records in the array under the object's first `key`; the rest of the text is read to its end."""
    win = Window(blocks(True))
    win.skip_ws()
    _to_key(win, key)
    yield from array_records(win, name, tolerant, limit, columns)
    win.drain()


def _to_key(win: Window, key: str) -> None:
    """Move to the value of the object's first `key` (the survey found it there), skipping other values."""
    win.pos += 1
    while True:
        win.skip_ws()
        found = _decode(win, "", _UNLIMITED)
        _expect(win, b":")
        win.skip_ws()
        if found == key:
            return
        win.scan_value(0)                # skipped: counted, never held
        _expect(win, b",")


# --------------------------------------------------------------------------- JSON lines

def text_lines(blocks, limit: int) -> Iterator[tuple[int, bytes | int]]:
    """(line number, line) of the text, every segment between newlines (the last one included), or
    (line number, length) for a line over `limit` bytes, which is counted and let go."""
    lineno, parts, size = 1, [], 0
    for block in blocks:
        start = 0
        while True:
            nl = block.find(b"\n", start)
            end = len(block) if nl < 0 else nl
            size += end - start
            if size <= limit:
                parts.append(block[start:end])
            else:
                parts = []
            if nl < 0:
                break
            yield lineno, b"".join(parts) if size <= limit else size
            lineno, parts, size, start = lineno + 1, [], 0, nl + 1
    yield lineno, b"".join(parts) if size <= limit else size


def line_records(lines, display: str, tolerant: bool, limit: int) -> Iterator[Record | Problem]:
    """Each JSON line as a Record, or (with `tolerant`) a Problem; without `tolerant` a bad line raises."""
    row = 0
    for lineno, body in lines:
        try:
            if isinstance(body, int) or len(body) > limit:
                raise DataError(display, lineno, oversize(body if isinstance(body, int) else len(body), limit,
                                                          "this line"))
            data = parse_json_line(body, display, lineno)
        except DataError as exc:
            if not tolerant:
                raise
            yield Problem(lineno, exc.detail)
            continue
        if data is not None:
            row += 1
            yield Record(data, row, lineno)


__all__ = ["json_records", "array_records", "line_records", "text_lines", "parse_value"]
