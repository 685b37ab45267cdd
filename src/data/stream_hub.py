"""Hub datasets read row by row through `datasets`.

By default a dataset is downloaded and prepared by `datasets` (an Arrow file on disk, memory-mapped),
and its rows are read one at a time from there. With `streaming: true` nothing is prepared: rows
come as `datasets` downloads them (an IterableDataset), so a dataset larger than the disk can train.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from ..errors import DataError
from .readers import Problem, Record, drop_missing, sized


def hub_records(name: str, split: str, subset: str | None, streaming: bool, tolerant: bool, limit: int,
                digest=None) -> Iterator[Record | Problem]:
    """The rows of split `split` of hub dataset `name` as records. `digest` is fed what fingerprints it:
    the prepared dataset's own fingerprint, or (streamed, where there is none) every row as it comes."""
    dataset = _load(name, split, subset, streaming)
    if digest is not None:
        seal = "streaming" if streaming else dataset._fingerprint
        digest.update(f"{name}|{subset}|{split}|{seal}".encode())
    yield from rows_as_records(iter(dataset), name, split, tolerant, limit, digest if streaming else None)


def rows_as_records(rows, name: str, split: str, tolerant: bool, limit: int,
                    digest=None) -> Iterator[Record | Problem]:
    """Each row a Record numbered by its place (held to `limit` once built); a failure while reading
    (the network, while streaming) is named with the row it stopped at."""
    row = 0
    while True:
        try:
            values = next(rows, None)
        except Exception as exc:   # datasets and its file systems raise many types
            raise DataError(name, None, f"reading the hub dataset stopped after row {row}: {_reason(exc)}") from None
        if values is None:
            break
        row += 1
        if digest is not None:
            digest.update(json.dumps(values, sort_keys=True, default=repr).encode())
        yield sized(Record(drop_missing(values), row), name, limit, tolerant)
    if not row:
        raise DataError(name, None, f"split {split!r} holds no records")


def _load(name: str, split: str, subset: str | None, streaming: bool):
    try:
        import datasets
    except ImportError:
        raise DataError(name, None, "reading hub datasets needs the `datasets` package: pip install datasets") from None
    try:
        return datasets.load_dataset(name, subset, split=split, streaming=streaming)
    except Exception as exc:   # network, missing dataset, bad split: all one message for the user
        raise DataError(name, None, "no local file by this name, and loading it as a hub dataset failed: "
                                    f"{_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
