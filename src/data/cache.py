"""Tokenized data on disk, keyed by everything that decides it.

The key hashes the bytes of every data file (or a hub dataset's fingerprint),
the tokenizer (vocabulary, merges, special tokens, chat template) and the
data settings that change tokens or masks. Anything else (packing, batch
sizes, shuffling) is applied after loading, so changing it keeps the cache.
An entry is a directory written to a temporary name and renamed, so a crash
never leaves a half entry behind (and the next writer removes the crashed
writer's folder: claims.py). SFT data, preference pairs, KTO, reward and
PRM examples are a token store (``store.py``: flat arrays read by memory map,
with the training and validation index arrays and ``meta.json``); other
methods' examples are ``arrays.npz`` and ``meta.json``. An entry damaged later (a truncated file, a disk error, bytes
that no longer match the checksums written with it) is never fatal: it is
named in one warning and the data is tokenized afresh.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..files import cache_dir
from . import claims
from .examples import AnyExample, Example, LabeledExample, PairExample, PromptExample, StepExample
from .store import StoreView, TokenStore, file_sha256

logger = logging.getLogger(__name__)

# What reading a damaged entry raises: numpy's zip reader (BadZipFile, zlib.error, EOFError), a cut
# array (ValueError), meta.json out of step with the arrays (KeyError, IndexError, TypeError).
DAMAGE = (OSError, ValueError, KeyError, IndexError, TypeError, EOFError, zipfile.BadZipFile, zlib.error)

# Bump when tokenization or the entry layout changes: older entries are then ignored.
CACHE_VERSION = 4   # 2: rl examples keep their prompt among the fields; 3: SFT data as a token store;
#                     4: the report carries the realised training mix

STAGING = r"\.[0-9a-f]{20}-.*"   # an entry's folder while it is written: ".<key>-XXXX"

# DataConfig fields that only affect batching, not tokens: they stay out of the key.
BATCHING_ONLY = ("packing", "tokens_per_batch", "group_by_length", "shuffle", "cache", "cache_dir", "num_proc")


def cache_root(cfg) -> Path:
    """data.cache_dir, or the data folder of mudpuppy's cache (files.cache_dir, shared with converted models)."""
    return cfg.resolve_path(cfg.data.cache_dir) if cfg.data.cache_dir else cache_dir("data")


def fingerprint_tokenizer(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    special = [type(tokenizer).__name__, getattr(tokenizer, "chat_template", None),
               tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, getattr(tokenizer, "add_bos_token", None)]
    h.update(json.dumps(special, default=str).encode())
    return h.hexdigest()


def cache_key(cfg, method: str, source_fingerprints: list[str], tokenizer) -> str:
    data = cfg.data.model_dump(mode="json", exclude=set(BATCHING_ONLY))
    parts = {"version": CACHE_VERSION, "sources": source_fingerprints, "tokenizer": fingerprint_tokenizer(tokenizer),
             "data": data, "seed": cfg.training.seed, "method": method}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


# --------------------------------------------------------------------------- (de)serialising examples

def to_parts(item: AnyExample) -> tuple[list[Example], dict]:
    """The sequences an example is made of, and its other fields (JSON-able)."""
    if isinstance(item, Example):
        return [item], {"kind": "example"}
    if isinstance(item, PairExample):
        return [item.chosen, item.rejected], {"kind": "pair"}
    if isinstance(item, LabeledExample):
        return [item.example], {"kind": "labeled", "label": item.label}
    if isinstance(item, StepExample):
        return [item.example], {"kind": "steps", "step_labels": item.step_labels.tolist()}
    if isinstance(item, PromptExample):
        return [item.prompt], {"kind": "prompt", "fields": item.fields}
    raise TypeError(f"cannot cache {type(item).__name__}")


def from_parts(seqs: list[Example], meta: dict, source: str) -> AnyExample:
    kind = meta["kind"]
    if kind == "example":
        return seqs[0]
    if kind == "pair":
        return PairExample(seqs[0], seqs[1], source)
    if kind == "labeled":
        return LabeledExample(seqs[0], meta["label"], source)
    if kind == "steps":
        return StepExample(seqs[0], np.asarray(meta["step_labels"], dtype=bool), source)
    return PromptExample(seqs[0], meta["fields"], source)


def pack_split(items: list[AnyExample], prefix: str) -> tuple[dict[str, np.ndarray], list[dict]]:
    ids, masks, lengths, metas = [], [], [], []
    for item in items:
        seqs, meta = to_parts(item)
        meta["source"] = item.source
        meta["sources"] = [s.source for s in seqs]
        metas.append(meta)
        for s in seqs:
            ids.append(s.input_ids)
            masks.append(s.loss_mask)
            lengths.append(len(s))
    arrays = {
        f"{prefix}_ids": np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, np.int32),
        f"{prefix}_mask": np.concatenate(masks).astype(bool) if masks else np.zeros(0, bool),
        f"{prefix}_lengths": np.asarray(lengths, dtype=np.int64),
    }
    return arrays, metas


def unpack_split(arrays, metas: list[dict], prefix: str) -> list[AnyExample]:
    ids, mask, lengths = arrays[f"{prefix}_ids"], arrays[f"{prefix}_mask"], arrays[f"{prefix}_lengths"]
    if len(ids) != len(mask) or int(lengths.sum()) != len(ids) or sum(len(m["sources"]) for m in metas) != len(lengths):
        raise ValueError(f"{prefix} arrays do not match meta.json")    # slicing would silently cut sequences
    starts = np.concatenate([[0], np.cumsum(lengths)])
    out, k = [], 0
    for meta in metas:
        seqs = []
        for src in meta["sources"]:
            a, b = starts[k], starts[k + 1]
            seqs.append(Example(ids[a:b].copy(), mask[a:b].copy(), src))
            k += 1
        out.append(from_parts(seqs, meta, meta["source"]))
    return out


# --------------------------------------------------------------------------- entries

@contextmanager
def staged_entry(root: Path, key: str) -> Iterator[Path]:
    """A folder to write the entry `key` into; renamed to root/key once the block completes."""
    target = root / key
    # Staging folders whose writers were killed (claims.py) go first: they were never entries.
    claims.sweep(root, STAGING)
    claim = claims.Claim(root, f".{key}-")
    staging = claim.folder
    try:
        yield staging
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(staging, target)
        except OSError:
            # Another process (a rank of the same distributed run) stored the same entry first.
            if not (target / "meta.json").is_file():
                raise
    finally:
        claim.release(remove=staging.exists())


def write_entry(root: Path, key: str, prepared) -> Path:
    """Store a PreparedData of any example type under `key` as arrays.npz; returns the entry directory."""
    with staged_entry(root, key) as staging:
        train_arrays, train_meta = pack_split(prepared.train, "train")
        val_arrays, val_meta = pack_split(prepared.val, "val")
        np.savez(staging / "arrays.npz", **train_arrays, **val_arrays)
        meta = {"version": CACHE_VERSION, "key": key, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                "train": train_meta, "val": val_meta, "val_records": prepared.val_records,
                "report": asdict(prepared.report)}
        (staging / "meta.json").write_text(json.dumps(meta, default=str))
    return root / key


def finish_store_entry(folder: Path, key: str, store_meta: dict, train: np.ndarray, val: np.ndarray,
                       prepared) -> None:
    """meta.json and the index arrays beside a token store written into `folder` (a staged entry)."""
    sums = {}
    for name, index in (("train", train), ("val", val)):
        path = folder / f"{name}.idx.bin"
        path.write_bytes(np.ascontiguousarray(index, dtype=np.int64).tobytes())
        sums[name] = file_sha256(path)
    meta = {"version": CACHE_VERSION, "key": key, "layout": "store", "created": time.strftime("%Y-%m-%d %H:%M:%S"),
            "store": store_meta, "index_sha256": sums, "val_records": prepared.val_records,
            "report": asdict(prepared.report)}
    (folder / "meta.json").write_text(json.dumps(meta, default=str))


def read_store_entry(entry: Path, meta: dict, verify: bool = True):
    """(train view, val view, val_records, report dict, created) of a token-store entry."""
    store = TokenStore(entry, meta["store"], verify=verify)
    views = []
    for name in ("train", "val"):
        path = entry / f"{name}.idx.bin"
        if verify and file_sha256(path) != meta["index_sha256"][name]:
            raise ValueError(f"{path.name} does not match the checksum written with it")
        index = np.fromfile(path, dtype=np.int64)
        if len(index) and (index.min() < 0 or index.max() >= len(store)):
            raise ValueError(f"{path.name} points outside the store")
        views.append(StoreView(store, index))
    return views[0], views[1], meta["val_records"], meta["report"], meta["created"]


def read_entry(root: Path, key: str):
    """(train, val, val_records, report dict, created) from a complete entry, or None: absent or of
    another version (silently), or damaged (one warning line); either way the caller tokenizes afresh."""
    entry = root / key
    if not (entry / "meta.json").is_file():
        return None
    try:
        meta = json.loads((entry / "meta.json").read_text())
        if not isinstance(meta, dict) or meta.get("version") != CACHE_VERSION or meta.get("key") != key:
            return None if isinstance(meta, dict) else _damaged(entry, "meta.json is not an object")
        if meta.get("layout") == "store":
            return read_store_entry(entry, meta)
        with np.load(entry / "arrays.npz", allow_pickle=False) as arrays:
            train = unpack_split(arrays, meta["train"], "train")
            val = unpack_split(arrays, meta["val"], "val")
        return train, val, meta["val_records"], meta["report"], meta["created"]
    except DAMAGE as exc:
        return _damaged(entry, f"{type(exc).__name__}: {str(exc)[:120]}")


def _damaged(entry: Path, reason: str) -> None:
    logger.warning("data cache entry %s is damaged (%s); tokenizing the data afresh (`mudpuppy preprocess` "
                   "rewrites the entry)", entry, reason)
    return None
