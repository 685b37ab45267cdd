"""A sliding window over JSON text, and a scanner that finds where one JSON value ends in it.

The scanner only tracks strings and brackets (json itself parses each value once its end is
found), so a value is held once, and one over the record limit is measured, not held: its bytes
are counted and let go as the window moves on. JSON's structural characters are ASCII and never
occur inside a UTF-8 multi-byte sequence, so the text is scanned as bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

_STRUCTURE = re.compile(rb'["\[\]{}]')
_STRING_BODY = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)
_SCALAR_END = re.compile(rb'[ \t\n\r,\]}\[{"]')
_OPEN = {ord("]"): ord("["), ord("}"): ord("{")}
_CONTINUATION = bytes(range(0x80, 0xC0))
WS = b" \t\n\r"


def chars(text: bytes) -> int:
    """Characters in UTF-8 `text`: every byte that does not continue a multi-byte sequence."""
    return len(text.translate(None, _CONTINUATION))


class Window:
    """The text from some position on, read block by block; lines counted as the window moves."""

    def __init__(self, blocks: Iterator[bytes]):
        self._blocks = iter(blocks)
        self.buf, self.pos, self.eof = b"", 0, False
        self._line, self._counted = 1, 0      # the line buf[_counted] is on
        self._cols = (0, 0)                   # characters and bytes before buf[0] on its line
        self._col_at = (0, 0, 0)              # the last column asked for: (position, characters, bytes)

    def more(self, keep: int) -> int:
        """Read a block on, letting go of the bytes before `keep`; the bytes let go, or -1 at the end."""
        block = None if self.eof else next(self._blocks, None)
        if block is None:
            self.eof = True
            return -1
        self.line_at(keep)
        head = self.buf[:keep]
        nl = head.rfind(b"\n")
        tail = head[nl + 1:]
        self._cols = (chars(tail), len(tail)) if nl >= 0 else (self._cols[0] + chars(head), self._cols[1] + keep)
        self.buf = self.buf[keep:] + block
        self.pos -= keep
        self._counted -= keep
        self._col_at = (0, *self._cols)
        return keep

    def line_at(self, at: int) -> int:
        """The line position `at` is on (positions asked for never go backwards)."""
        self._line += self.buf.count(b"\n", self._counted, at)
        self._counted = at
        return self._line

    def column_at(self, at: int) -> tuple[int, int]:
        """(characters, bytes) before position `at` on its line. Counted on from the last position asked
        for (positions asked for never go backwards), so a long line of records costs one count, not one
        per record."""
        last, before_chars, before_bytes = self._col_at
        nl = self.buf.rfind(b"\n", last, at)
        if nl >= 0:
            last, before_chars, before_bytes = nl + 1, 0, 0
        counted = (before_chars + chars(self.buf[last:at]), before_bytes + at - last)
        self._col_at = (at, *counted)
        return counted

    def skip_ws(self) -> int | None:
        """The byte at the first non-whitespace position from pos on (pos moved there), None at the end."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in WS:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if self.more(self.pos) < 0:
                return None

    def drain(self) -> None:
        """Read to the end (so that a digest over the blocks sees the whole file)."""
        while self.more(len(self.buf)) >= 0:
            pass

    def scan_value(self, limit: int) -> tuple[int, int, bool]:
        """Find the end of the JSON value at pos: (start, size in bytes, held). When held, the value is
        buf[start:start + size] and pos is past it; a value over `limit` bytes is only counted (held False).
        A bracket closing the wrong one ends the value there: json then reports what is wrong with it."""
        base, dropped, p = self.pos, 0, self.pos     # the value's bytes still held start at base
        stack, in_string, scalar = bytearray(), False, False
        first = self.buf[p]
        if first in b"[{":
            stack.append(first)
        elif first == ord('"'):
            in_string = True
        else:
            scalar = True
        p += 1
        while True:
            if scalar:
                m = _SCALAR_END.search(self.buf, p)
                p, done = (m.start(), True) if m else (len(self.buf), False)
            else:
                p, in_string, done = _scan(self.buf, p, stack, in_string)
            if done:
                break
            held = dropped + p - base <= limit
            keep = base if held else p
            let_go = self.more(keep)
            if let_go < 0:
                p = len(self.buf)
                break
            dropped += 0 if held else keep - base
            base, p = 0, p - let_go
        self.pos = p
        size = dropped + p - base
        return base, size, size <= limit


def _scan(buf: bytes, p: int, stack: bytearray, in_string: bool) -> tuple[int, bool, bool]:
    """Scan buf from p: (where it stopped, inside a string, value done)."""
    while True:
        if in_string:
            end = _STRING_BODY.match(buf, p).end()
            if end >= len(buf) or buf[end] != 0x22:
                return end, True, False           # the block ends inside the string (or on a backslash)
            p, in_string = end + 1, False
            if not stack:
                return p, False, True
            continue
        m = _STRUCTURE.search(buf, p)
        if m is None:
            return len(buf), False, False
        c, p = buf[m.start()], m.end()
        if c == 0x22:
            in_string = True
        elif c in b"[{":
            stack.append(c)
        elif stack[-1] != _OPEN[c]:
            return p, False, True
        else:
            stack.pop()
            if not stack:
                return p, False, True
