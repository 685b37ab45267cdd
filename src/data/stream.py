"""JSON lines (plain or gzip/bzip2/xz-compressed) read record by record, never the whole file at once.

SFT data from a `.jsonl` / `.ndjson` file is read twice: a scan before the
model loads (every record parsed, its format detected on the first DETECT
records and every record checked against it, so data errors still stop the
run before anything heavy happens; nothing kept but counts and a few probe
records), then again while tokenizing, in chunks of raw lines (`RawLines`)
that the worker tokenizing a chunk parses: this process parses each record
once, in the scan. Each pass holds one line (or one chunk's lines) at a
time; a line longer than `data.max_record_bytes` is measured, not held.

The messages are those the whole-file JSON-lines reader gave, at the same lines, and so is
the order in which they win: a malformed line anywhere beats a format problem,
which beats a bad field. Files this module does not split into lines (UTF-16/32 text,
zstd, zip, other formats) are streamed record by record by sources.py's readers and
reach the workers as parsed records.
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataError
from .formats import detect_format, normalize_record, rename_fields
from .limits import oversize
from .readers import Problem, RawSource, Record, data_suffix, is_local, parse_json_line, record_error
from .sources import source_records
from .stream_json import line_records
from .text_source import compression, open_content
from .tools import uses_tools

DETECT = 1000          # records the format is detected on (today's rule, all records, for files this short)
KEEP = 1000            # a file of at most this many records is kept in memory after the scan, as before
HEAD = 4096            # bytes checked for NUL (UTF-16 without a byte-order mark), as readers.as_utf8_text does
SHOWN = 20             # problems kept by message; the rest are counted
_WIDE_BOMS = (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


def streamable(path: Path, spec=None) -> bool:
    """A dataset this module reads record by record: any local data file (JSON lines split here, other
    formats read by sources.py), or, given its `spec`, a hub dataset."""
    return path.is_file() if is_local(path) else spec is not None


def _damaged(kind: str, display: str, exc: Exception) -> DataError:
    return DataError(display, None, f"not a readable {kind[1:]} file ({exc}); is it complete?")


def lines(path: Path, display: str, limit: int, digest=None) -> Iterator[tuple[int, bytes | int]]:
    """(line number, line without its end) of the text as readers.as_utf8_text leaves it (no UTF-8 BOM,
    CRLF as LF, a trailing Ctrl-Z dropped), or (line number, length) for a line over `limit` bytes."""
    kind = compression(path)
    try:
        with open_content(path, display) as f:
            head = f.read(HEAD + 3)
        head = head.removeprefix(codecs.BOM_UTF8).replace(b"\r\n", b"\n")[:HEAD]
        if b"\x00" in head:
            raise DataError(display, head.count(b"\n", 0, head.index(b"\x00")) + 1,
                            "holds NUL bytes: the file looks like UTF-16 text without a byte-order mark; "
                            "re-save it as UTF-8")
        with open_content(path, display) as f:
            yield from _split(f, limit, digest)
    except (OSError, EOFError, ValueError) as exc:
        if kind is None or isinstance(exc, DataError):
            raise
        raise _damaged(kind, display, exc) from None


def _split(f, limit: int, digest) -> Iterator[tuple[int, bytes | int]]:
    """readers.limits.line_spans over a stream: every segment between newlines, the last one (empty when
    the text ends with a newline) included; a segment over `limit` bytes comes as its length."""
    lineno, pending = 0, None     # one segment of lookahead: only the last one loses a trailing Ctrl-Z
    while True:
        line = f.readline(limit + 3 + (3 if lineno == 0 else 0))   # room for CRLF, one byte over, a BOM
        _hash(digest, line)
        lineno += 1
        bom = 3 if lineno == 1 and line.startswith(codecs.BOM_UTF8) else 0
        ended = line.endswith(b"\n")
        if not ended and len(line) - bom > limit + 2:
            seg, ended = _measure(f, line, digest)
            seg -= bom
        else:
            seg = (line.removesuffix(b"\n").removesuffix(b"\r") if ended else line)[bom:]
        if pending is not None:
            yield pending
        pending = (lineno, seg)
        if not ended:
            break
    n, seg = pending
    yield n, seg.rstrip(b"\x1a") if isinstance(seg, bytes) else seg


def _measure(f, start: bytes, digest) -> tuple[int, bool]:
    """The length of a line too long to keep (as the whole-file reader counts it: CRLF as one byte, the
    newline not counted), read on in blocks that are dropped; and whether a newline ended it."""
    size, tail, ctrl_z = len(start), start[-2:], _ctrl_z(start, 0)
    while True:
        more = f.readline(1 << 20)
        _hash(digest, more)
        if not more:
            return size - ctrl_z, False         # the file's last line: its trailing Ctrl-Z is dropped
        size += len(more)
        ctrl_z = _ctrl_z(more, ctrl_z)
        tail = (tail + more)[-2:]
        if more.endswith(b"\n"):
            return size - (2 if tail == b"\r\n" else 1), True


def _ctrl_z(block: bytes, before: int) -> int:
    """Ctrl-Z bytes ending the text once `block` follows `before` of them."""
    kept = len(block.rstrip(b"\x1a"))
    return before + len(block) if kept == 0 else len(block) - kept


def _hash(digest, data: bytes) -> None:
    if digest is not None:
        digest.update(data)


def records(path: Path, display: str, tolerant: bool, limit: int, digest=None,
            spec=None) -> Iterator[Record | Problem]:
    """Each line as a Record, or (with `tolerant`) a Problem; without `tolerant` a bad line raises. Files
    other than UTF-8 JSON lines (plain, gzip, bzip2, xz), and the hub dataset a `spec` names, are read
    record by record by sources.py."""
    if not _split_here(path, display):
        yield from source_records(path, display, tolerant, limit, digest, spec)
        return
    yield from line_records(lines(path, display, limit, digest), display, tolerant, limit)


def _split_here(path: Path, display: str) -> bool:
    """A local UTF-8 JSON-lines file, plain or gzip/bzip2/xz-compressed, that lines() reads."""
    if not (is_local(path) and path.is_file() and data_suffix(path) in (".jsonl", ".ndjson")):
        return False
    if path.suffix.lower() == ".zip" or compression(path) == ".zst":     # zstd: by suffix or first bytes
        return False
    with open_content(path, display) as f:
        return not f.read(4).startswith(_WIDE_BOMS)


def parse_line(body: bytes | int, display: str, lineno: int, limit: int) -> dict | None:
    """One line (or a too-long line's length, as `lines` gives it) as a record; None for a blank line."""
    if isinstance(body, int) or len(body) > limit:
        raise DataError(display, lineno, oversize(body if isinstance(body, int) else len(body), limit, "this line"))
    return parse_json_line(body, display, lineno)


# --------------------------------------------------------------------------- the two passes

@dataclass
class Tally:
    """Problems of one kind: how many, and the first SHOWN of them."""

    count: int = 0
    shown: list[Problem] = field(default_factory=list)

    def add(self, problem: Problem) -> None:
        self.count += 1
        if len(self.shown) < SHOWN:
            self.shown.append(problem)


@dataclass
class Scan:
    format: str
    count: int                  # records that will be tokenized
    fingerprint: str
    probe: list[Record]         # the few records that decide template and tool-format questions
    records: list[Record] | None   # every record, for a file of at most KEEP of them; else read again
    skipped: list[Problem]      # the first bad records (reader's first, then fields'), as read_file orders them
    skipped_total: int
    last_line: int | None = None   # the line of the last record read (num_samples may stop before the end)


def _renamed(path: Path, name: str, spec, tolerant: bool, limit: int, digest=None) -> Iterator[Record | Problem]:
    """Records with the dataset's field_map applied, and problems; the first num_samples records only."""
    taken = 0
    for item in records(path, name, tolerant, limit, digest, spec):
        if isinstance(item, Record):
            if spec.num_samples is not None and taken >= spec.num_samples:
                return
            taken += 1
            item.data = rename_fields(item.data, spec.field_map)
        yield item


class _Scanner:
    """Pass one: detect, check every record, keep counts and probes; errors in read_file's order."""

    def __init__(self, name: str, declared: str, tolerant: bool):
        self.name, self.tolerant = name, tolerant
        self.format = None if declared == "auto" else declared
        self.declared, self.buffer = declared, []
        self.read, self.fields = Tally(), Tally()
        self.count, self.probe, self.deferred, self.kept = 0, {}, None, []
        self.last_line = None

    def add(self, item: Record | Problem) -> None:
        if isinstance(item, Record):
            self.last_line = item.line
        if isinstance(item, Problem):
            self.read.add(item)
        elif self.format is not None:
            self.check(item)
        elif self.deferred is None:
            self.buffer.append(item)
            if len(self.buffer) >= DETECT:
                self.detect()

    def detect(self) -> None:
        try:
            self.format = detect_format(RawSource(self.name, self.buffer, ""), self.declared, self.tolerant)
        except DataError as exc:        # a malformed line later still wins, as when the whole file was read
            self.deferred = exc
            return
        for rec in self.buffer:
            self.check(rec)
        self.buffer = []

    def check(self, rec: Record) -> None:
        try:
            data = normalize_record(self.format, rec.data)
        except ValueError as exc:
            if not self.tolerant:
                self.deferred = self.deferred or record_error(self.name, rec, str(exc))
            else:
                self.fields.add(Problem(rec.line, str(exc)))
            return
        self.count += 1
        record = Record(data, rec.row, rec.line)
        if self.kept is not None:
            self.kept = self.kept if self.count <= KEEP else None
        if self.kept is not None:
            self.kept.append(record)
        prompts = ("prompt", "completion", "chosen", "rejected")
        for kind, hit in (("first", True), ("lists", any(isinstance(data.get(k), list) for k in prompts)),
                          ("tools", uses_tools(data)), ("schemas", bool(data.get("tools")))):
            if hit and kind not in self.probe:
                self.probe[kind] = record

    def finish(self, fingerprint: str) -> Scan:
        if self.format is None and self.deferred is None:
            if not self.buffer:
                if not self.read.count:
                    raise DataError(self.name, None, "the file holds no records")
                first = self.read.shown[0]
                raise DataError(self.name, first.line, f"no usable records: all {self.read.count} were bad; "
                                                       f"the first: {first.message}")
            self.detect()
        if self.deferred is not None:
            raise self.deferred
        problems = self.read.shown + self.fields.shown
        if not self.count:
            raise DataError(self.name, problems[0].line, f"no usable records: all {self.read.count + self.fields.count} "
                                                         f"were bad; the first: {problems[0].message}")
        return Scan(self.format, self.count, fingerprint, list(self.probe.values()), self.kept, problems,
                    self.read.count + self.fields.count, self.last_line)


def scan(path: Path, name: str, spec, tolerant: bool, limit: int) -> Scan:
    """Pass one over a JSON-lines file: every record read and checked, nothing kept."""
    digest = hashlib.sha256()
    scanner = _Scanner(name, spec.type, tolerant)
    for item in _renamed(path, name, spec, tolerant, limit, digest):
        scanner.add(item)
    return scanner.finish(digest.hexdigest())


def reread(path: Path, name: str, spec, fmt: str, tolerant: bool, limit: int, until: int | None = None
           ) -> Reread:
    """Pass two: the records the scan counted, normalized, in file order (bad ones were counted then);
    `until`, the scan's `last_line`, where num_samples stopped it."""
    return Reread(path, LineParser(name, spec.field_map, fmt, tolerant, limit), spec, until)


@dataclass(frozen=True)
class LineParser:
    """Raw JSON lines to the records pass two yields: what a tokenizing worker needs to parse its own chunk
    (small and picklable, so the parent process reads lines and never parses them a second time)."""

    name: str
    field_map: dict | None
    fmt: str
    tolerant: bool
    limit: int

    def parse(self, lines: list[tuple[int, bytes | int]], row: int) -> list[Record]:
        """Records of these (line number, line) pairs; `row` numbers the first (bad lines skipped with
        `tolerant` are not counted back: rows only show for files without lines)."""
        out = []
        for lineno, body in lines:
            try:
                data = parse_line(body, self.name, lineno, self.limit)
            except DataError:
                if self.tolerant:
                    continue
                raise                       # the file changed since the scan
            if data is not None:
                out += self.normalized(Record(rename_fields(data, self.field_map), row + len(out), lineno))
        return out

    def normalized(self, item: Record) -> list[Record]:
        """The record in its format's normal form; none where it is bad and bad records are tolerated."""
        try:
            return [Record(normalize_record(self.fmt, item.data), item.row, item.line)]
        except ValueError as exc:
            if self.tolerant:
                return []
            raise record_error(self.name, item, str(exc)) from None      # the file changed since the scan


@dataclass
class RawLines:
    """One chunk of a file's lines, parsed where it is tokenized (`records()`, in a worker)."""

    parser: LineParser
    row: int
    lines: list[tuple[int, bytes | int]]

    def records(self) -> list[Record]:
        return self.parser.parse(self.lines, self.row)


@dataclass
class Reread:
    """Pass two over a scanned file: iterated, its records (parsed here); `line_chunks`, a JSON-lines file's
    raw lines (any other file's records, parsed here)."""

    path: Path
    parser: LineParser
    spec: object
    until: int | None = None

    def _lines(self) -> Iterator[tuple[int, bytes | int]]:
        for lineno, body in lines(self.path, self.parser.name, self.parser.limit):
            if self.until is not None and lineno > self.until:
                return
            yield lineno, body

    def __iter__(self) -> Iterator[Record]:
        p = self.parser
        for item in _renamed(self.path, p.name, self.spec, p.tolerant, p.limit):
            if isinstance(item, Record):
                yield from p.normalized(item)

    def line_chunks(self, size: int) -> Iterator[RawLines | list[Record]]:
        """`size` lines that are not blank at a time (blank ones hold no record and are left out here); lists
        of records where lines cannot be cut apart unparsed, or num_samples must be counted without the
        scan's last line."""
        if not _split_here(self.path, self.parser.name) or self.spec.num_samples is not None and self.until is None:
            records = iter(self)
            while chunk := list(itertools.islice(records, size)):
                yield chunk
            return
        chunk, row = [], 1
        for lineno, body in self._lines():
            if not body or isinstance(body, bytes) and body.isspace():
                continue
            chunk.append((lineno, body))
            if len(chunk) == size:
                yield RawLines(self.parser, row, chunk)
                chunk, row = [], row + size
        if chunk:
            yield RawLines(self.parser, row, chunk)
