"""Preference pairs, KTO examples and reward data as training items and batches. numpy only.

An `Item` is what one preference, KTO or reward example trains on: its
sequences in a fixed role order, a label, and (when precomputed) reference
log-probs, one per sequence. An `ItemBatch` pads every sequence of every
item into one `Batch`, role-major (all chosen rows, then all rejected rows,
as TRL lays them out), so one forward pass serves both roles.

Roles per item:

    pair (dpo, ipo, simpo, orpo, rm)   [chosen, rejected]
    kto                                [completion, mismatched completion for the KL estimate]
    reward {text, label}               [text]
    prm                                [text], with one class label per step token

Pairs from a token store (store.py, kind "pair") stay there: `pair_items` of a
StoreView is an `ItemView`, a sequence of Items built from the maps on access,
and `drop_screened` and `with_reference` work on index and reference arrays.

Bad pairs are found here too, on the records, before any model loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from .batch import IGNORE_INDEX, Batch, collate
from .examples import Example, LabeledExample, PairExample, StepExample
from .prepared import LoadedDataset
from .stream import RawLines
from .store import StoreView
from .workers import chunk_place, ordered_map


@dataclass
class Item:
    sequences: tuple[Example, ...]
    label: float = 0.0
    ref_logps: np.ndarray | None = None   # float [roles], the reference's summed log-probs
    source: str = ""

    def __len__(self) -> int:
        return max(len(s) for s in self.sequences)


@dataclass
class ItemBatch:
    batch: Batch                  # [roles * size, T], role-major
    size: int                     # items
    roles: int                    # sequences per item
    labels: np.ndarray            # float [size]
    ref_logps: np.ndarray | None = None   # float [roles * size], role-major like the rows

    @property
    def real_tokens(self) -> int:
        return self.batch.real_tokens


# --------------------------------------------------------------------------- items

def pair_items(pairs: list[PairExample] | StoreView) -> list[Item] | ItemView:
    if isinstance(pairs, StoreView):
        return ItemView(pairs, pair_item)
    return [pair_item(pairs, i) for i in range(len(pairs))]


def scored_items(examples: list[LabeledExample] | StoreView) -> list[Item] | ItemView:
    """Reward data {text, label}: one sequence, a float label."""
    if isinstance(examples, StoreView):
        return ItemView(examples, scored_item)
    return [scored_item(examples, i) for i in range(len(examples))]


def kto_items(examples: list[LabeledExample] | StoreView, sequence_len: int) -> list[Item] | ItemView:
    """Each KTO example with a mismatched sequence: its prompt, the previous example's completion.

    KTO estimates the policy's KL from the reference on (prompt, completion)
    pairs that do not belong together. TRL rotates completions by one inside
    each batch of a sequential dataset; here the rotation is over the whole
    dataset, once, so the pairing stays fixed whatever order batches come in
    (shuffled epochs, resume) and its reference log-probs can be precomputed.
    """
    build = partial(kto_item, sequence_len=sequence_len)
    if isinstance(examples, StoreView):
        return ItemView(examples, build, measure=partial(kto_lengths, sequence_len=sequence_len))
    return [build(examples, i) for i in range(len(examples))]


def kto_lengths(view: StoreView, sequence_len: int) -> np.ndarray:
    """`len(kto_item(view, i))` for every position of the view, from the store's arrays alone: the longer of
    the example and its mismatched sequence (its prompt, then the previous example's completion, cut at
    `sequence_len`)."""
    full = view.lengths.astype(np.int64)
    prompt = view.store.prompt_lengths()[view.index]
    mismatched = np.minimum(prompt + np.roll(full - prompt, 1), sequence_len)
    return np.maximum(full, mismatched)


def pair_item(pairs, i: int) -> Item:
    p = pairs[i]
    return Item((p.chosen, p.rejected), source=p.source)


def scored_item(examples, i: int) -> Item:
    e = examples[i]
    return Item((e.example,), float(e.label), source=e.source)


def kto_item(examples, i: int, sequence_len: int) -> Item:
    ex = examples[i]
    prompt_ids, _, _ = split_completion(ex.example)
    _, ids, mask = split_completion(examples[(i - 1) % len(examples)].example)
    kl = Example(np.concatenate([prompt_ids, ids])[:sequence_len],
                 np.concatenate([np.zeros(len(prompt_ids), bool), mask])[:sequence_len], ex.source)
    return Item((ex.example, kl), 1.0 if ex.label else 0.0, source=ex.source)


class ItemView(Sequence):
    """The Items of a token store's view, each made on access by `build(view, position)` (as the list
    functions above make them from a list); a slice keeps the positions, so what an item is paired with
    (KTO) does not change. `ref` holds the reference log-probs ([len, roles], float32) once computed.
    `measure(view)` gives every position's item length where an item is not as long as its example (KTO)."""

    def __init__(self, view: StoreView, build, positions: np.ndarray | None = None,
                 ref: np.ndarray | None = None, measure=None):
        self.view, self.build, self.ref, self.measure = view, build, ref, measure
        self.positions = np.arange(len(view), dtype=np.int64) if positions is None else positions
        self._lengths = None

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return ItemView(self.view, self.build, self.positions[i], None if self.ref is None else self.ref[i],
                            self.measure)
        item = self.build(self.view, int(self.positions[i]))
        if self.ref is not None:
            item.ref_logps = self.ref[i]
        return item

    @property
    def lengths(self) -> np.ndarray:
        """What the Batcher plans with: the view's length array where an item is as long as its example, else
        (KTO's mismatched sequence) `measure`'s, from the store's arrays: no item is built."""
        if self._lengths is None:
            every = self.view.lengths if self.measure is None else self.measure(self.view)
            self._lengths = every[self.positions]
        return self._lengths


def split_completion(ex: Example) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt ids, completion ids, completion mask): the completion starts at the first trained token."""
    trained = np.flatnonzero(ex.loss_mask)
    start = int(trained[0]) if len(trained) else len(ex)
    return ex.input_ids[:start], ex.input_ids[start:], ex.loss_mask[start:]


def with_reference(items: list[Item], ref_logps: np.ndarray) -> list[Item]:
    """Items carrying precomputed reference log-probs ([len(items), roles])."""
    if isinstance(items, ItemView):
        return ItemView(items.view, items.build, items.positions, np.asarray(ref_logps, dtype=np.float32),
                        items.measure)
    return [Item(it.sequences, it.label, np.asarray(ref, dtype=np.float32), it.source)
            for it, ref in zip(items, ref_logps)]


# --------------------------------------------------------------------------- batches

def collate_items(items: list[Item], pad_id: int) -> ItemBatch:
    roles = len(items[0].sequences)
    rows = [it.sequences[r] for r in range(roles) for it in items]
    ref = None
    if all(it.ref_logps is not None for it in items):
        ref = np.asarray([it.ref_logps[r] for r in range(roles) for it in items], dtype=np.float32)
    labels = np.asarray([it.label for it in items], dtype=np.float32)
    return ItemBatch(collate(rows, pad_id), len(items), roles, labels, ref)


def collate_steps(examples: list[StepExample], pad_id: int) -> ItemBatch:
    """PRM: labels are the step classes (0 wrong, 1 right) at each step's last token, unshifted:
    a token-classification head scores the token itself, not the next one."""
    batch = collate([e.example for e in examples], pad_id)
    labels = np.full(batch.input_ids.shape, IGNORE_INDEX, dtype=np.int64)
    for row, e in enumerate(examples):
        at = np.flatnonzero(e.example.loss_mask)
        labels[row, at] = e.step_labels[: len(at)].astype(np.int64)
    step_labels = labels[labels != IGNORE_INDEX].astype(np.float32)
    return ItemBatch(Batch(batch.input_ids, labels, batch.attention_mask), len(examples), 1, step_labels)


def role_batch(items: ItemBatch, role: int) -> Batch:
    """The rows of one role (e.g. KTO's mismatched sequences), trimmed to their own longest."""
    rows = slice(role * items.size, (role + 1) * items.size)
    width = max(int(items.batch.attention_mask[rows].sum(axis=1).max()), 1)
    b = items.batch
    return Batch(b.input_ids[rows, :width], b.labels[rows, :width], b.attention_mask[rows, :width])


def fixed_item_batches(items: list, batch_size: int, pad_id: int, collate_fn=collate_items) -> list[ItemBatch]:
    """Evaluation batches in file order."""
    return [collate_fn(items[i : i + batch_size], pad_id) for i in range(0, len(items), batch_size)]


# --------------------------------------------------------------------------- bad pairs

@dataclass
class Screening:
    """Records that would teach nothing (or nonsense), found before tokenizing."""

    bad: dict[str, str] = field(default_factory=dict)    # source -> reason
    where: list[tuple[str, int]] = field(default_factory=list)   # (dataset name, line or row) of each

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for reason in self.bad.values():
            out[reason] = out.get(reason, 0) + 1
        return out


IDENTICAL = "chosen and rejected are identical"
EMPTY = "empty completion"


def screen_records(datasets: list[LoadedDataset], workers: int = 1) -> Screening:
    """Identical pairs and empty completions in preference and KTO datasets (others pass). A streamed file
    is read again, chunk by chunk, its raw lines parsed and screened in `workers` processes."""
    found = Screening()
    for ds in datasets:
        if ds.stream is None:
            bad = screen_chunk(None, (ds.name, ds.format, ds.records))
        else:
            jobs = ((ds.name, ds.format, chunk) for chunk in ds.jobs(SCREEN_CHUNK))
            procs = workers if ds.record_count() > SCREEN_CHUNK else 1
            screened = ordered_map(screen_chunk, jobs, None, procs, lambda job: chunk_place(job[0], job[2]),
                                   "screening")
            bad = [b for found_here in screened for b in found_here]
        for source, reason, at in bad:
            found.bad[source] = reason
            found.where.append((ds.name, at))
    return found


SCREEN_CHUNK = 2048      # records per screening job


def screen_chunk(_, job: tuple) -> list[tuple[str, str, int]]:
    """(source, reason, line or row) of each bad record of one chunk (in a worker, where streamed)."""
    name, fmt, chunk = job
    records = chunk.records() if isinstance(chunk, RawLines) else chunk
    out = []
    for rec in records:
        reason = bad_record_reason(fmt, rec.data)
        if reason:
            out.append((record_source(name, rec), reason, rec.line if rec.line is not None else rec.row))
    return out


def bad_record_reason(fmt: str, data: dict) -> str | None:
    if fmt == "preference":
        if data["chosen"] == data["rejected"]:
            return IDENTICAL
        if not content_text(data["chosen"]) or not content_text(data["rejected"]):
            return EMPTY
    elif fmt == "kto" and not content_text(data["completion"]):
        return EMPTY
    return None


def content_text(value) -> str:
    if isinstance(value, str):
        return value.strip()
    return "".join(m.get("content", "") for m in value).strip()


def record_source(name: str, rec) -> str:
    """How tokenize.tokenize_records names an example's origin, so screened records find their examples."""
    return f"{name}:{rec.line}" if rec.line is not None else f"{name} row {rec.row}"


def drop_screened(examples: list | StoreView, screening: Screening) -> list | StoreView:
    if isinstance(examples, StoreView):
        return drop_from_view(examples, screening.where)
    return [ex for ex in examples if ex.source not in screening.bad]


def drop_from_view(view: StoreView, where: list[tuple[str, int]]) -> StoreView:
    """The view without the examples at `where` ((dataset name, line or row)): on the index arrays."""
    if not where:
        return view
    store = view.store
    origin = np.asarray(store.arrays["dataset"])[view.index]
    lines = np.asarray(store.arrays["lines"])[view.index]
    bad = np.zeros(len(view), dtype=bool)
    for d, name in enumerate(store.names):
        at = [line for n, line in where if n == name]
        if at:
            bad |= (origin == d) & np.isin(lines, at)
    return StoreView(store, view.index[~bad])
