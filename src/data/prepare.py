"""Config to tokenized train/validation sets: the entry points pipelines call.

Two stages, so that data problems surface before any model loads:

    loaded = load_data(cfg)                       # read, detect formats, validate; no tokenizer
    data = prepare_sft_data(cfg, tokenizer, loaded)   # tokenize (or reuse the cache), split, weight
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..errors import ConfigError, DataError
from . import cache
from .examples import AnyExample
from .formats import check_method_format, detect_format, normalize_records, rename_fields
from .prepared import (  # noqa: F401  (re-exported: evaluation and training import them from here)
    EVAL_TOOL_FORMAT, SKIPPED_SHOWN, DataReport, LoadedData, LoadedDataset, PreparedData, fit_length,
    record_for_eval, render_options,
)
from .readers import is_local
from .sources import read_source
from .templates import apply_chat_template_choice, template_warnings
from .tokenize import needs_template, tokenize_records, tool_format_for
from .tools import uses_tools
from .tokenizers import load_text_tokenizer
from .vision import is_vision_model, is_vision_tokenizer, load_vision_tokenizer, vision_problems
from .images import resolve_images
from ..distributed import Ranks
from .pipeline import STREAMED, mix_indices, prepare_store, stored
from .shared import prepare_shared
from .stream import reread, scan, streamable

# --------------------------------------------------------------------------- stage 1: records

def display_name(path: Path) -> str:
    """A path as short as it can be while still pointing at the file from here."""
    rel = os.path.relpath(path) if path.is_absolute() else str(path)
    return rel if not rel.startswith("..") else str(path)


def load_dataset(cfg, spec, images: bool = False, stream: bool = False) -> LoadedDataset:
    """Read one dataset and check every record against its format; with `images` (a vision-language
    model), chat records may show images, whose files are found and checked here. With `stream` (SFT
    data, which the token store takes chunk by chunk), a JSON-lines file is scanned, not kept."""
    tolerant = cfg.data.skip_bad_records
    path = cfg.resolve_path(spec.path)
    name = display_name(path) if is_local(path) else spec.path
    if "tool" in spec.roles_to_train:
        raise DataError(name, None, "roles_to_train includes 'tool', but tool results never carry loss: they are "
                                    "what a tool returned, not what the model writes; leave 'tool' out")
    if stream and not images and streamable(path, spec):
        return scan_dataset(cfg, spec, path, name)
    raw = read_source(path, name, split=spec.split, subset=spec.subset, tolerant=tolerant,
                      max_record_bytes=cfg.data.max_record_bytes, streaming=spec.streaming)
    raw.records = raw.records[: spec.num_samples]
    for rec in raw.records:
        rec.data = rename_fields(rec.data, spec.field_map)
    fmt = detect_format(raw, spec.type, tolerant)
    records = normalize_records(raw, fmt, tolerant, images=images and fmt == "chat")
    if images and fmt == "chat":
        records = resolve_images(raw, records, path.parent if is_local(path) else None, tolerant)
    skipped = [f"{name}:{p.line}: {p.message}" if p.line is not None else f"{name}: {p.message}"
               for p in raw.problems]
    return LoadedDataset(spec, name, fmt, records, raw.fingerprint, skipped)


def scan_dataset(cfg, spec, path: Path, name: str) -> LoadedDataset:
    """A JSON-lines dataset checked in one streamed pass (stream.py); read again when tokenized."""
    tolerant, limit = cfg.data.skip_bad_records, cfg.data.max_record_bytes
    found = scan(path, name, spec, tolerant, limit)
    skipped = [f"{name}:{p.line}: {p.message}" for p in found.skipped]
    if found.records is not None:          # a small file: kept, as every file was before streaming
        return LoadedDataset(spec, name, found.format, found.records, found.fingerprint, skipped,
                             skipped_total=found.skipped_total)
    return LoadedDataset(spec, name, found.format, [], found.fingerprint, skipped,
                         stream=lambda: reread(path, name, spec, found.format, tolerant, limit, found.last_line),
                         count=found.count, skipped_total=found.skipped_total, probe=found.probe)


def load_data(cfg, method: str | None = None) -> LoadedData:
    """Every dataset read and validated, and its format checked against the method."""
    method = method or cfg.data_method()
    images = is_vision_model(cfg.model)
    stream = method in STREAMED
    loaded = LoadedData([load_dataset(cfg, s, images, stream) for s in cfg.data.datasets],
                        [load_dataset(cfg, s, images, stream) for s in cfg.data.val_datasets])
    for ds in loaded.train + loaded.val:
        check_method_format(method, ds.format, ds.name)
    return loaded


# --------------------------------------------------------------------------- stage 2: tokens

def tokenize_dataset(ds: LoadedDataset, tokenizer, has_template: bool,
                     report: DataReport | None = None) -> tuple[list[AnyExample], list[dict]]:
    opts = render_options(ds.spec, has_template)
    if has_template and needs_template(ds.format, ds.records, opts):
        opts = replace(opts, tool_format=tool_format_for(tokenizer, opts, ds.records))
        if report is not None and any(uses_tools(r.data) for r in ds.records):
            report.tool_formats[ds.spec.path] = opts.tool_format
    examples = tokenize_records(tokenizer, ds.format, ds.records, opts, ds.name)
    return examples, [record_for_eval(ds.format, r.data, opts) for r in ds.records]


def split_validation(train: list, records: list[dict], origin: list[int], size: float, seed: int):
    """Hold out `size` (a fraction or a count) of the training pool, drawn from the seed."""
    n_val = int(size) if size >= 1 else max(1, round(len(train) * size))
    if n_val >= len(train):
        raise DataError("data.val_set_size", None,
                        f"holds out {n_val} of {len(train)} examples, leaving none to train on")
    held = set(np.random.default_rng(seed).permutation(len(train))[:n_val].tolist())
    keep = [i for i in range(len(train)) if i not in held]
    val_idx = sorted(held)
    return ([train[i] for i in keep], [records[i] for i in keep], [origin[i] for i in keep],
            [train[i] for i in val_idx], [records[i] for i in val_idx])


def load_tokenizer(model_cfg, model_dir: Path | str):
    """The tokenizer training will tokenize with, loaded without the model (`mudpuppy preprocess`).

    A vision-language model's processor (it renders and expands the images as
    training will), else the Hugging Face tokenizer of `model.tokenizer` or
    the resolved `model_dir`, padding with EOS where it names no pad token, the
    way both backends set it up: the cache key depends on it.
    """
    if is_vision_model(model_cfg):
        return load_vision_tokenizer(model_cfg.tokenizer or str(model_dir), model_cfg.trust_remote_code)
    return load_text_tokenizer(model_cfg, model_dir)



def prepare_data(cfg, tokenizer, loaded: LoadedData | None = None, *, method: str | None = None,
                 use_cache: bool | None = None, write_cache: bool = False, refresh: bool = False,
                 ranks: Ranks | None = None) -> PreparedData:
    """Tokenized train and validation examples for `method` (default: the config's), for the processes of
    `ranks` (the backend's distributed.Ranks; None: one process).

    With the cache on (``data.cache``, or `use_cache`), a matching entry
    written by `mudpuppy preprocess` is reused unless `refresh`; with
    `write_cache`, a freshly tokenized result is stored for later runs.
    """
    loaded = loaded or load_data(cfg, method)
    ranks = ranks or Ranks()
    template = apply_chat_template_choice(tokenizer, cfg.data.chat_template)
    use_cache = cfg.data.cache if use_cache is None else use_cache
    if is_vision_tokenizer(tokenizer):
        # The model turned out to be a vision-language one: its settings are checked here too (a hub
        # model's kind is known once it is downloaded), and its tokens, which depend on the image
        # files, are not cached.
        problems = vision_problems(cfg, True)
        if problems:
            raise ConfigError("the config", [f"{where}: {what}" for where, what in problems])
        use_cache = False
    key = cache.cache_key(cfg, method or cfg.data_method(), loaded.fingerprints(), tokenizer) if use_cache else None
    root = cache.cache_root(cfg)
    warnings = template_warnings(tokenizer, cfg.data.chat_template)
    if stored(method or cfg.data_method(), loaded) and not is_vision_tokenizer(tokenizer):
        # SFT examples go to a memory-mapped token store (pipeline.py): flat memory at any data size; in a
        # distributed run one rank per machine reads or writes it and every rank maps it (shared.py).
        def here():
            hit = None if key is None or refresh else reuse_entry(root, key)
            if hit is not None:
                return hit, root / key, False
            prepared, folder = prepare_store(cfg, tokenizer, loaded, template is not None, key, root, write_cache,
                                             warnings, keep_scratch=ranks.distributed)
            return prepared, folder, prepared.report.cache != "written"
        return prepare_shared(ranks, here) if ranks.distributed else here()[0]
    if key is not None and not refresh:
        hit = reuse_entry(root, key)
        if hit is not None:
            return hit
    prepared = tokenize_all(cfg, tokenizer, loaded, template is not None)
    prepared.report.warnings += warnings
    if is_vision_tokenizer(tokenizer) and cfg.data.cache:
        prepared.report.warnings.append("data.cache: image data is tokenized afresh for each run (its tokens "
                                        "depend on the image files, which the cache does not track)")
    if key is not None:
        prepared.report.cache = "fresh"
        if write_cache:
            path = cache.write_entry(root, key, prepared)
            prepared.report.cache, prepared.report.cache_path = "written", str(path)
    return prepared


def reuse_entry(root: Path, key: str) -> PreparedData | None:
    """The cache entry `key`, when it is there whole (cache.read_entry), as prepared data."""
    hit = cache.read_entry(root, key)
    if hit is None:
        return None
    train, val, val_records, report_dict, created = hit
    report = DataReport(**report_dict)
    report.cache, report.cache_path, report.cache_created = "reused", str(root / key), created
    return PreparedData(train, val, val_records, report)


def tokenize_group(datasets: list[LoadedDataset], tokenizer, has_template: bool, cfg, report: DataReport):
    """Examples, eval records and dataset index of each, for a list of datasets, length-fitted."""
    examples, records, origin = [], [], []
    for d, ds in enumerate(datasets):
        ex, rec = fit_length(*tokenize_dataset(ds, tokenizer, has_template, report), cfg.data.sequence_len,
                             cfg.data.truncation, report)
        report.per_dataset[ds.spec.path] = len(ex)
        report.formats[ds.spec.path] = ds.format
        report.skipped += ds.skipped_count()
        report.skipped_at += ds.skipped[: max(0, SKIPPED_SHOWN - len(report.skipped_at))]
        examples += ex
        records += rec
        origin += [d] * len(ex)
    return examples, records, origin


def tokenize_all(cfg, tokenizer, loaded: LoadedData, has_template: bool) -> PreparedData:
    report = DataReport()
    train, train_rec, origin = tokenize_group(loaded.train, tokenizer, has_template, cfg, report)
    val, val_rec, _ = tokenize_group(loaded.val, tokenizer, has_template, cfg, report)
    if not train:
        raise DataError(loaded.train[0].name, None, "no usable training examples after length filtering "
                        f"({report.dropped_too_long} too long, {report.dropped_no_target} with no trained tokens)")
    if cfg.data.val_set_size and not loaded.val:
        train, train_rec, origin, val, val_rec = split_validation(
            train, train_rec, origin, cfg.data.val_set_size, cfg.training.seed)
    train = [train[i] for i in mix_indices(np.arange(len(train)), np.asarray(origin, dtype=np.int64),
                                           [ds.spec for ds in loaded.train], cfg.training.seed)]

    report.train_examples, report.val_examples = len(train), len(val)
    seqs = [s for ex in train for s in ex.sequences()]
    total = sum(len(s) for s in seqs)
    report.loss_token_share = sum(int(s.loss_mask[1:].sum()) for s in seqs) / max(total, 1)
    return PreparedData(train, val, val_rec, report)


def prepare_sft_data(cfg, tokenizer, loaded: LoadedData | None = None, **kwargs) -> PreparedData:
    """SFT data: chat, text, instruction or completion datasets, as Examples."""
    return prepare_data(cfg, tokenizer, loaded or load_data(cfg, "sft"), method="sft", **kwargs)
