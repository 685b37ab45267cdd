"""A data file's content as a stream of blocks: decompressed, taken out of its zip archive, and (for text)
made plain UTF-8 with LF line ends, as `readers.as_utf8_text` once made the whole file.

Every streamed reader (stream_json.py, stream_tables.py) reads through here, so memory is one block
(BLOCK bytes) plus whatever record the reader is building, never the file. The messages are the ones
the whole-file reader gave: a damaged archive, a zip holding several files, UTF-16 without a byte-order
mark, bytes that are not UTF-8 (file:line and column).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from pathlib import Path

from ..errors import DataError
from .readers import data_suffix

BLOCK = 1 << 20          # bytes read at a time
HEAD = 4096              # bytes checked for NUL (UTF-16 text without a byte-order mark)
_SUFFIX_KINDS = (".gz", ".bz2", ".xz", ".zst")
# Compressed files misnamed without their suffix are recognised by these (binary) first bytes.
_MAGIC = {b"\x1f\x8b": ".gz", b"\xfd7zXZ\x00": ".xz", b"\x28\xb5\x2f\xfd": ".zst"}
_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
              (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def compression(path: Path) -> str | None:
    """.gz/.bz2/.xz/.zst by the file's suffix, else by its first bytes; None for a plain file."""
    kind = path.suffix.lower()
    if kind in _SUFFIX_KINDS:
        return kind
    with open(path, "rb") as f:
        head = f.read(6)
    return next((k for magic, k in _MAGIC.items() if head.startswith(magic)), None)


def zip_member(path: Path, display: str) -> str:
    """The one data file inside a .zip archive."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile as exc:
        raise DataError(display, None, f"not a readable zip file ({exc})") from None
    members = [m for m in names if not m.endswith("/") and not m.startswith("__MACOSX/")]
    if len(members) != 1:
        raise DataError(display, None, f"a zip archive must hold exactly one data file; this one holds "
                                       f"{len(members)}: {', '.join(members[:5])}")
    return members[0]


def content_suffix(path: Path, display: str) -> str:
    """The format suffix of what the file holds: a zip archive's is its member's."""
    if path.suffix.lower() == ".zip":
        return data_suffix(Path(zip_member(path, display)))
    return data_suffix(path)


def open_content(path: Path, display: str):
    """The file's content as a binary stream: decompressed, or the zip archive's one member."""
    if path.suffix.lower() == ".zip":
        import zipfile

        member = zip_member(path, display)
        with zipfile.ZipFile(path) as archive:      # the member keeps the file open until it is closed
            return archive.open(member)
    kind = compression(path)
    if kind is None:
        return open(path, "rb")
    if kind == ".zst":
        try:
            import zstandard
        except ImportError:
            raise DataError(display, None, "reading zstd-compressed files needs the zstandard package: "
                                           "pip install zstandard (or decompress it: zstd -d FILE)") from None
        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    module = __import__({".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}[kind])
    return module.open(path, "rb")


def raw_blocks(path: Path, display: str, digest=None) -> Iterator[bytes]:
    """The content's bytes, BLOCK at a time; a damaged archive is named as the whole-file reader named it."""
    kind = ".zip" if path.suffix.lower() == ".zip" else compression(path)
    with open_content(path, display) as f:
        while True:
            try:
                block = f.read(BLOCK)
            except DataError:
                raise
            except Exception as exc:   # each library raises its own type for a damaged stream
                if kind is None:
                    raise
                raise DataError(display, None, f"not a readable {kind[1:]} file ({exc}); is it complete?") from None
            if not block:
                return
            _hash(digest, block)
            yield block


def text_blocks(path: Path, display: str, digest=None) -> Iterator[bytes]:
    """The content as UTF-8 text with LF line ends: a UTF-16/32 file (found by its byte-order mark)
    re-encoded; a UTF-8 BOM, the CR of each CRLF and a trailing Ctrl-Z dropped; line numbers unchanged.
    `digest` sees the text as it comes out, so it fingerprints what the whole-file reader hashed."""
    first, pending, held = True, b"", b""      # held: the first HEAD bytes, checked for NUL before any is given
    for block in _utf8(raw_blocks(path, display), display):
        if first:
            block, first = block.removeprefix(codecs.BOM_UTF8), False
        block = pending + block
        keep = len(block) - (1 if block.endswith(b"\r") else 0)      # a CR whose LF may come next
        keep = len(block[:keep].rstrip(b"\x1a"))                     # Ctrl-Z counts only at the very end
        out, pending = block[:keep].replace(b"\r\n", b"\n"), block[keep:]
        if held is not None:
            held += out
            if len(held) < HEAD:
                continue
            _refuse_nul(held, display)
            out, held = held, None
        if out:
            _hash(digest, out)
            yield out
    out = (held or b"") + pending.rstrip(b"\x1a")
    if held is not None:
        _refuse_nul(out, display)
    if out:
        _hash(digest, out)
        yield out


def _hash(digest, data: bytes) -> None:
    if digest is not None:
        digest.update(data)


def _refuse_nul(text: bytes, display: str) -> None:
    head = text[:HEAD]
    if b"\x00" in head:
        raise DataError(display, head.count(b"\n", 0, head.index(b"\x00")) + 1,
                        "holds NUL bytes: the file looks like UTF-16 text without a byte-order mark; re-save it as UTF-8")


def _utf8(blocks: Iterator[bytes], display: str) -> Iterator[bytes]:
    """UTF-8 blocks as they are, or a UTF-16/32 text (by its byte-order mark) re-encoded as UTF-8."""
    head = b""
    for block in blocks:
        head += block
        if len(head) >= 4:
            break
    codec = next((c for bom, c in _WIDE_BOMS if head.startswith(bom)), None)
    if codec is None:
        if head:
            yield head
        yield from blocks
        return
    decoder, seen = codecs.getincrementaldecoder(codec)(), 0
    for block in _chain(head, blocks):
        buffered = len(decoder.getstate()[0])
        try:
            yield decoder.decode(block).encode("utf-8")
        except UnicodeDecodeError as exc:
            at = seen - buffered + exc.start
            raise DataError(display, None, f"starts with a {codec.upper()} byte-order mark but is not valid "
                                           f"{codec.upper()} text at byte {at}; re-save it as UTF-8") from None
        seen += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        raise DataError(display, None, f"starts with a {codec.upper()} byte-order mark but is not valid "
                                       f"{codec.upper()} text at byte {seen - (exc.end - exc.start)}; "
                                       "re-save it as UTF-8") from None


def _chain(head: bytes, blocks: Iterator[bytes]) -> Iterator[bytes]:
    yield head
    yield from blocks


def not_utf8(text: bytes, start: int, line: int, column_base: int) -> tuple[int, str]:
    """(line, description) of the first byte of `text` that is not UTF-8, found at offset `start`; `line` is
    the line `text` begins on, `column_base` the bytes before it on that line."""
    before = text.rfind(b"\n", 0, start)
    column = start - before if before >= 0 else column_base + start + 1
    bad = text[start:start + 1]
    return (line + text.count(b"\n", 0, start),
            f"not UTF-8 text (byte {bad!r} at column {column}); re-save the file as UTF-8")


def first_bad_utf8(blocks) -> tuple[int, str] | None:
    """(line, description) of the first byte of the text that is not UTF-8, or None: the whole-file
    reader checked this before anything else, so a later bad byte still beats an earlier malformed record."""
    line, column, carry = 1, 0, b""
    for block in blocks:
        data = carry + block
        try:
            data.decode("utf-8")
            good, carry = len(data), b""
        except UnicodeDecodeError as exc:
            if exc.reason != "unexpected end of data" or exc.end != len(data):
                blocks.close()
                return not_utf8(data, exc.start, line, column)
            good, carry = exc.start, data[exc.start:]
        nl = data.rfind(b"\n", 0, good)
        column = good - nl - 1 if nl >= 0 else column + good
        line += data.count(b"\n", 0, good)
    return not_utf8(carry, 0, line, column) if carry else None
