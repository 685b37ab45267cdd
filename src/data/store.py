"""Tokenized SFT examples on disk as flat arrays, read back by memory map.

A store is a folder of raw little arrays, appended chunk by chunk while the
data is tokenized, so neither writing nor reading ever holds the whole data
set in memory:

    tokens.bin    int32  every example's token ids, end to end
    mask.bin      bool   their loss masks, the same length
    lengths.bin   int32  one length per sequence; offsets are their running sum
    targets.bin   int32  loss-carrying tokens per sequence (token 0 never is one), for the report
    lines.bin     int64  each example's line in its file (or row, for files without lines)
    dataset.bin   int32  which dataset each example came from (an index into `names`)
    records.bin   JSON   the record behind an example, as evaluation reads it, for examples that may be
    records.idx   int64  held out: its start in records.bin (-1 where none was kept) and its length
    records_len.bin

An example is one sequence (kind "example": SFT), several in a fixed role
order (kind "pair": a preference pair, chosen then rejected, stored one after
the other), one with a label (kind "labeled": KTO's bool, a reward score;
`labels.bin`, float64, one per example), or one with its PRM step labels (kind
"steps": `step_labels.bin`, bool, end to end, and `step_counts.bin`, int32,
one count per example); lengths and targets are per sequence, the other
arrays per example.

A `StoreView` is a sequence of Examples (or PairExamples) picked by an index array: the
training set, the held-out set, a weighted mix. Building one example costs
two slices of the maps, whatever the store's size; everything a batcher
plans with (lengths) is one small array per view.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .examples import Example, LabeledExample, PairExample, StepExample

ARRAYS = {"tokens": np.int32, "mask": np.bool_, "lengths": np.int32, "targets": np.int32,
          "lines": np.int64, "dataset": np.int32, "records_idx": np.int64, "records_len": np.int64}
PER_TOKEN = ("tokens", "mask")
PER_SEQUENCE = ("lengths", "targets")
KINDS = {"example": 1, "pair": 2, "labeled": 1, "steps": 1}      # sequences per example
PROMPT_BLOCK = 8192     # sequences per block of the mask read for `prompt_lengths`
# Each kind's extra arrays (float64 labels: a reward score reads back exact), and how `pack` fills them.
EXTRAS = {"labeled": {"labels": np.float64}, "steps": {"step_labels": np.bool_, "step_counts": np.int32}}


def arrays_of(kind: str) -> dict:
    return {**ARRAYS, **EXTRAS.get(kind, {})}


def extras_of(examples: list) -> dict[str, np.ndarray]:
    if isinstance(examples[0], LabeledExample):
        return {"labels": np.asarray([float(e.label) for e in examples], dtype=np.float64)}
    if isinstance(examples[0], StepExample):
        return {"step_labels": np.concatenate([e.step_labels for e in examples]).astype(np.bool_),
                "step_counts": np.asarray([len(e.step_labels) for e in examples], dtype=np.int32)}
    return {}


def _file(name: str) -> str:
    return "records.idx" if name == "records_idx" else f"{name}.bin"


class StoreWriter:
    """Appends tokenized chunks to a store folder; `close()` returns the meta describing it."""

    def __init__(self, folder: Path, kind: str = "example"):
        self.folder, self.kind, self.roles = Path(folder), kind, KINDS[kind]
        self.dtypes, self.extra_sizes = arrays_of(kind), {}
        self.folder.mkdir(parents=True, exist_ok=True)
        self._files = {name: open(self.folder / _file(name), "wb") for name in self.dtypes}
        self._hashes = {name: hashlib.sha256() for name in self.dtypes}
        self._records = open(self.folder / "records.bin", "wb")
        self._records_at = 0
        self.names: list[str] = []
        self.by_row: list[bool] = []
        self.count = 0
        self.tokens = 0

    def add_dataset(self, name: str, by_row: bool) -> int:
        self.names.append(name)
        self.by_row.append(by_row)
        return len(self.names) - 1

    def _put(self, name: str, values) -> None:
        data = np.ascontiguousarray(values, dtype=self.dtypes[name]).tobytes()
        self._files[name].write(data)
        self._hashes[name].update(data)

    def append(self, dataset: int, packed: dict[str, np.ndarray], lines: list[int], records: list[str] | None) -> None:
        """Examples of one dataset, in order, as `pack` gives them; `records` (JSON text, one per example)
        when they may be held out."""
        count = len(packed["lengths"]) // self.roles
        if not count:
            return
        for name in ("tokens", "mask", "lengths", "targets"):
            self._put(name, packed[name])
        self._put("lines", lines)
        for name in EXTRAS.get(self.kind, ()):
            self._put(name, packed[name])
            self.extra_sizes[name] = self.extra_sizes.get(name, 0) + len(packed[name])
        self._put("dataset", np.full(count, dataset))
        starts, sizes = np.full(count, -1, dtype=np.int64), np.zeros(count, dtype=np.int64)
        for i, text in enumerate(records or ()):
            data = text.encode()
            starts[i], sizes[i] = self._records_at, len(data)
            self._records.write(data)
            self._records_at += len(data)
        self._put("records_idx", starts)
        self._put("records_len", sizes)
        self.count += count
        self.tokens += len(packed["tokens"])

    def close(self) -> dict:
        for f in (*self._files.values(), self._records):
            f.close()
        return {"kind": self.kind, "extra_sizes": self.extra_sizes, "names": self.names, "by_row": self.by_row,
                "count": self.count, "tokens": self.tokens, "records_bytes": self._records_at,
                "sha256": {k: h.hexdigest() for k, h in self._hashes.items()}}

    def abort(self) -> None:
        for f in (*self._files.values(), self._records):
            f.close()


def pack(examples: list[Example]) -> dict[str, np.ndarray]:
    """Examples as the store's flat arrays: a few arrays cross from a worker to the writer, not an object each.
    A pair's sequences go in role order (chosen, rejected)."""
    extras = extras_of(examples) if examples else {}
    if examples and not isinstance(examples[0], Example):
        examples = [s for e in examples for s in e.sequences()]
    if not examples:
        return {name: np.zeros(0, dtype=ARRAYS[name]) for name in ("tokens", "mask", "lengths", "targets")}
    return {"tokens": np.concatenate([e.input_ids for e in examples]).astype(np.int32, copy=False),
            "mask": np.concatenate([e.loss_mask for e in examples]).astype(np.bool_, copy=False),
            "lengths": np.asarray([len(e) for e in examples], dtype=np.int32),
            "targets": np.asarray([int(e.loss_mask[1:].sum()) for e in examples], dtype=np.int32), **extras}


class TokenStore:
    """A store folder opened by memory map; `verify` re-reads every file against the sha256 written with it."""

    def __init__(self, folder: Path, meta: dict, verify: bool = False):
        self.folder = Path(folder)
        self.names, self.by_row = list(meta["names"]), list(meta["by_row"])
        self.kind = meta.get("kind", "example")
        self.roles = KINDS[self.kind]
        sizes = {name: meta["tokens"] if name in PER_TOKEN else meta["count"] * (self.roles if name in PER_SEQUENCE
                 else 1) for name in arrays_of(self.kind)}
        sizes.update(meta.get("extra_sizes", {}))
        self.arrays: dict[str, np.ndarray] = {}
        for name, dtype in arrays_of(self.kind).items():
            path = self.folder / _file(name)
            expected = sizes[name] * np.dtype(dtype).itemsize
            if path.stat().st_size != expected:    # a cut file would silently shorten sequences
                raise ValueError(f"{path.name} holds {path.stat().st_size} bytes where meta.json calls for {expected}")
            if verify and file_sha256(path) != meta["sha256"][name]:
                raise ValueError(f"{path.name} does not match the checksum written with it")
            # np.memmap refuses an empty file; an empty array is what it would hold.
            self.arrays[name] = (np.memmap(path, dtype=dtype, mode="r", shape=(sizes[name],)) if sizes[name]
                                 else np.zeros(0, dtype=dtype))
        # An example's length is its longest sequence's (PairExample's len), what batches are planned with.
        self.lengths = self.per_example("lengths", np.maximum)
        self.offsets = np.concatenate([[0], np.cumsum(self.arrays["lengths"], dtype=np.int64)])
        if self.kind == "steps":
            self.step_offsets = np.concatenate([[0], np.cumsum(self.arrays["step_counts"], dtype=np.int64)])
        if self.offsets[-1] != sizes["tokens"]:
            raise ValueError("lengths.bin does not add up to tokens.bin")
        self._records = self.folder / "records.bin"
        self._prompts = None

    def __len__(self) -> int:
        return len(self.lengths)

    def per_example(self, name: str, reduce=np.add) -> np.ndarray:
        """A per-sequence array (lengths, targets) reduced over each example's sequences."""
        values = np.asarray(self.arrays[name])
        return values if self.roles == 1 else reduce.reduce(values.reshape(-1, self.roles), axis=1)

    def prompt_lengths(self) -> np.ndarray:
        """Per sequence, where its loss-carrying tokens start (its length where it has none): what
        `pairs.split_completion` calls the prompt. Read from the mask map a block of sequences at a time."""
        if self._prompts is None:
            starts, mask = self.offsets, self.arrays["mask"]
            out = np.empty(len(starts) - 1, dtype=np.int64)
            for a in range(0, len(out), PROMPT_BLOCK):
                b = min(a + PROMPT_BLOCK, len(out))
                trained = np.flatnonzero(mask[starts[a] : starts[b]]) + starts[a]
                first = np.append(trained, starts[b])[np.searchsorted(trained, starts[a:b])]
                out[a:b] = np.minimum(first, starts[a + 1 : b + 1]) - starts[a:b]
            self._prompts = out
        return self._prompts

    def example(self, k: int) -> Example | PairExample | LabeledExample:
        if self.kind == "steps":
            a, b = self.step_offsets[k], self.step_offsets[k + 1]
            step_labels = np.asarray(self.arrays["step_labels"][a:b])
            return StepExample(self.sequence(k, self.source(k)), step_labels, self.source(k))
        if self.kind == "labeled":
            return LabeledExample(self.sequence(k, self.source(k)), float(self.arrays["labels"][k]), self.source(k))
        if self.roles == 1:
            return self.sequence(k, self.source(k))
        source = self.source(k)
        return PairExample(*(self.sequence(k * self.roles + r, source) for r in range(self.roles)), source)

    def sequence(self, j: int, source: str) -> Example:
        a, b = self.offsets[j], self.offsets[j + 1]
        return Example(np.asarray(self.arrays["tokens"][a:b]), np.asarray(self.arrays["mask"][a:b]), source)

    def source(self, k: int) -> str:
        d, line = int(self.arrays["dataset"][k]), int(self.arrays["lines"][k])
        return f"{self.names[d]} row {line}" if self.by_row[d] else f"{self.names[d]}:{line}"

    def record(self, k: int) -> dict | None:
        """The record behind example k, as evaluation reads it, where one was kept."""
        start = int(self.arrays["records_idx"][k])
        if start < 0:
            return None
        with open(self._records, "rb") as f:
            f.seek(start)
            return json.loads(f.read(int(self.arrays["records_len"][k])))

    def view(self, index) -> StoreView:
        return StoreView(self, np.asarray(index, dtype=np.int64))


class StoreView(Sequence):
    """Examples of a store picked by an index array (repeats allowed): a list for every reader of examples."""

    def __init__(self, store: TokenStore, index: np.ndarray):
        self.store, self.index = store, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return StoreView(self.store, self.index[i])
        return self.store.example(int(self.index[i]))

    @property
    def lengths(self) -> np.ndarray:
        return self.store.lengths[self.index]

    def total_tokens(self) -> int:
        """Tokens of every sequence (both of a pair)."""
        return int(self.store.per_example("lengths")[self.index].sum(dtype=np.int64))

    def target_tokens(self) -> int:
        return int(self.store.per_example("targets")[self.index].sum(dtype=np.int64))

    def datasets(self) -> np.ndarray:
        return np.asarray(self.store.arrays["dataset"])[self.index]

    def records(self) -> list[dict]:
        return [self.store.record(int(k)) for k in self.index]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
