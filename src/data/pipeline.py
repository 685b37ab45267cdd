"""SFT data into a memory-mapped token store: chunks of records -> worker processes -> store.

    records (in chunks of CHUNK)  ->  render + tokenize + fit to length (data.num_proc workers)
                                  ->  appended to the store, in file order
    store  ->  validation split, dataset weights or ratios: index arrays  ->  StoreViews for training

The tokens and masks are those `prepare.tokenize_all` makes (a test compares
them on every format and template in the test data); only where they live
changes. Preference pairs (dpo, ipo, simpo, orpo, and rm on pairs) go to a store
of kind "pair" the same way (`stored`), KTO and {text, label} reward data to one
of kind "labeled", PRM data to one of kind "steps"; RL prompts and
vision-language data keep `tokenize_all`'s lists.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..errors import DataError
from . import cache, claims
from .prepared import SKIPPED_SHOWN, DataReport, LoadedData, LoadedDataset, PreparedData, fit_length, \
    record_for_eval, render_options
from .store import StoreView, StoreWriter, TokenStore, pack
from .stream import RawLines
from .templates import require_chat_template
from .tokenize import needs_template, tokenize_records, tool_format_for
from .tools import uses_tools
from .workers import available_cores, chunk_place, ordered_map

# Stores this process has tokenized: a distributed run's report counts them per rank (shared.py), so a rank
# that tokenized when it should only have mapped shows.
BUILT = [0]
SCRATCH = r"store-.*"   # an uncached store's folder under <cache_dir>/.scratch
CHUNK = 512    # records per job: the tokenizer's batch size, and small enough to keep a worker's memory flat
STREAMED = ("sft", "dpo", "ipo", "simpo", "orpo", "kto", "prm")   # methods whose files are scanned at load, then read again
KIND_OF = {"preference": "pair", "kto": "labeled", "reward": "labeled", "prm": "steps"}   # store kinds of the other formats


def stored(method: str, loaded: LoadedData) -> bool:
    """Whether `method`'s data goes to a token store: SFT data, preference pairs, KTO, reward and PRM examples."""
    return method == "sft" or store_kind(loaded) != "example"


def store_kind(loaded: LoadedData) -> str:
    formats = {ds.format for ds in loaded.train + loaded.val}
    return KIND_OF.get(formats.pop(), "example") if len(formats) == 1 else "example"


def num_workers(cfg) -> int:
    return cfg.data.num_proc or available_cores()


def tokenize_chunk(tokenizer, job: tuple) -> tuple:
    """One chunk of records, or of raw lines to parse first (in a worker): the kept examples as the store's
    flat arrays, their lines, eval records (JSON) when asked, and the (truncated, too long, no target) counts."""
    fmt, chunk, opts, name, max_len, policy, keep = job
    records = chunk.records() if isinstance(chunk, RawLines) else chunk
    examples = tokenize_records(tokenizer, fmt, records, opts, name)
    report = DataReport()
    positions = list(range(len(records)))
    kept, at = fit_length(examples, positions, max_len, policy, report)
    lines = [records[i].line if records[i].line is not None else records[i].row for i in at]
    texts = [json.dumps(record_for_eval(fmt, records[i].data, opts), default=str) for i in at] if keep else None
    return pack(kept), lines, texts, (report.truncated, report.dropped_too_long, report.dropped_no_target)


def dataset_options(tokenizer, ds: LoadedDataset, has_template: bool, report: DataReport):
    """The dataset's render options, its tool format settled over all its records, as `tokenize_dataset`
    and `tokenize_records` settle it for a whole list (the template is required up front, not per chunk)."""
    opts = render_options(ds.spec, has_template)
    probe = ds.probe_records()
    if needs_template(ds.format, probe, opts):
        require_chat_template(tokenizer, ds.name)
        opts = replace(opts, tool_format=tool_format_for(tokenizer, opts, probe))
        if has_template and any(uses_tools(r.data) for r in probe):
            report.tool_formats[ds.spec.path] = opts.tool_format
    return opts


def write_dataset(writer: StoreWriter, ds: LoadedDataset, tokenizer, has_template: bool, cfg,
                  report: DataReport, keep_records: bool, workers: int) -> None:
    opts = dataset_options(tokenizer, ds, has_template, report)
    probe = ds.probe_records()
    d = writer.add_dataset(ds.name, bool(probe) and probe[0].line is None)
    before = writer.count
    jobs = ((ds.format, chunk, opts, ds.name, cfg.data.sequence_len, cfg.data.truncation, keep_records)
            for chunk in ds.jobs(CHUNK))
    # Forking workers costs more than one chunk takes to tokenize: small data stays in this process.
    procs = workers if ds.record_count() > CHUNK else 1
    where = lambda job: chunk_place(ds.name, job[1])       # noqa: E731 - the chunk a dead worker was on
    for kept, lines, texts, (truncated, too_long, no_target) in ordered_map(tokenize_chunk, jobs, tokenizer, procs,
                                                                            where):
        writer.append(d, kept, lines, texts)
        report.truncated += truncated
        report.dropped_too_long += too_long
        report.dropped_no_target += no_target
    report.dropped = report.dropped_too_long + report.dropped_no_target
    report.per_dataset[ds.spec.path] = writer.count - before
    report.formats[ds.spec.path] = ds.format
    report.skipped += ds.skipped_count()
    report.skipped_at += ds.skipped[: max(0, SKIPPED_SHOWN - len(report.skipped_at))]


def build_store(cfg, tokenizer, loaded: LoadedData, has_template: bool, folder: Path) -> tuple[dict, DataReport]:
    """Tokenize every dataset (training ones first) into a store at `folder`; (store meta, report)."""
    report = DataReport()
    writer = StoreWriter(folder, store_kind(loaded))
    hold_out = bool(cfg.data.val_set_size) and not loaded.val
    workers = num_workers(cfg)
    try:
        for ds in loaded.train:
            write_dataset(writer, ds, tokenizer, has_template, cfg, report, hold_out, workers)
        for ds in loaded.val:
            write_dataset(writer, ds, tokenizer, has_template, cfg, report, True, workers)
    finally:
        meta = writer.close()
    return meta, report


def select(cfg, store: TokenStore, loaded: LoadedData, report: DataReport) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) indices into the store: the split and the weights, as `tokenize_all` applies
    them to lists."""
    origin = np.asarray(store.arrays["dataset"])
    train = np.flatnonzero(origin < len(loaded.train))
    val = np.flatnonzero(origin >= len(loaded.train))
    if not len(train):
        raise DataError(loaded.train[0].name, None, "no usable training examples after length filtering "
                        f"({report.dropped_too_long} too long, {report.dropped_no_target} with no trained tokens)")
    if cfg.data.val_set_size and not loaded.val:
        train, val = split_indices(train, cfg.data.val_set_size, cfg.training.seed)
    return mix_indices(train, origin[train], [ds.spec for ds in loaded.train], cfg.training.seed), val


def split_indices(train: np.ndarray, size: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Hold out `size` (a fraction or a count) of the training pool, drawn from the seed (`split_validation`)."""
    n_val = int(size) if size >= 1 else max(1, round(len(train) * size))
    if n_val >= len(train):
        raise DataError("data.val_set_size", None,
                        f"holds out {n_val} of {len(train)} examples, leaving none to train on")
    held = np.zeros(len(train), dtype=bool)
    held[np.random.default_rng(seed).permutation(len(train))[:n_val]] = True
    return train[~held], train[held]


def mix_indices(train: np.ndarray, origin: np.ndarray, specs: list, seed: int) -> np.ndarray:
    """The training mix on indices: the datasets' `ratio`s where they set them, else their `weight`s."""
    if any(getattr(s, "ratio", None) is not None for s in specs):
        return ratio_indices(train, origin, [s.ratio for s in specs], seed)
    return weight_indices(train, origin, [s.weight for s in specs], seed)


def ratio_counts(ratios: list[float], total: int) -> list[int]:
    """Examples per dataset for `total` in all: each ratio * total rounded by largest remainder, so they add up
    to `total` and each is within one example of its exact share."""
    exact = np.asarray(ratios, dtype=np.float64) / sum(ratios) * total
    counts = np.floor(exact).astype(np.int64)
    order = sorted(range(len(ratios)), key=lambda d: (-(exact[d] - counts[d]), d))
    for d in order[: total - int(counts.sum())]:
        counts[d] += 1
    return counts.tolist()


def ratio_indices(train: np.ndarray, origin: np.ndarray, ratios: list[float], seed: int) -> np.ndarray:
    """A mix of the training set's size in which dataset d holds ratio[d] of the examples: a dataset short of
    its share is repeated whole and topped up with a seeded draw, a larger one sampled down (seeded)."""
    out = []
    for d, want in enumerate(ratio_counts(ratios, len(train))):
        mine = train[origin == d]
        if not len(mine):
            # Named by position: the dataset's examples were all dropped or held out, so no ratio can be met.
            raise DataError(f"data.datasets[{d}]", None, f"ratio {ratios[d]:g} asks for {want} examples, but none "
                            "of this dataset's are left after length filtering and the validation split")
        whole, rest = divmod(want, len(mine))
        extra = np.random.default_rng([seed, d]).choice(len(mine), rest, replace=False)
        out += [np.tile(mine, whole), mine[np.sort(extra)]]
    return np.concatenate(out)


def weight_indices(train: np.ndarray, origin: np.ndarray, weights: list, seed: int) -> np.ndarray:
    """Each dataset's share scaled: weight 2 repeats it twice, 0.5 keeps a seeded half."""
    if all(w is None or w == 1 for w in weights):
        return train
    out = []
    for d, weight in enumerate(weights):
        mine = train[origin == d]
        if weight is None or weight == 1 or not len(mine):
            out.append(mine)
            continue
        whole, rest = divmod(round(weight * len(mine)), len(mine))
        extra = np.random.default_rng([seed, d]).choice(len(mine), rest, replace=False)
        out += [np.tile(mine, whole), mine[np.sort(extra)]]
    return np.concatenate(out)


def open_prepared(store: TokenStore, train: np.ndarray, val: np.ndarray, report: DataReport,
                  specs: list) -> PreparedData:
    """The views training reads, and the report's totals, which need nothing but the index arrays."""
    train_view, val_view = store.view(train), store.view(val)
    report.train_examples, report.val_examples = len(train_view), len(val_view)
    report.loss_token_share = train_view.target_tokens() / max(train_view.total_tokens(), 1)
    report.mix = realised_mix(train_view, specs) if store.kind == "example" else []   # as tokenize_all: SFT
    return PreparedData(train_view, val_view, val_view.records(), report)


def realised_mix(train: StoreView, specs: list) -> list[dict]:
    """Per training dataset, what the mix holds of it: examples, tokens, trained (loss-carrying) tokens,
    and its share of the examples and of the trained tokens, beside the ratio or weight asked."""
    origin = train.datasets()
    tokens = np.bincount(origin, weights=train.lengths, minlength=len(specs))
    targets = np.asarray(train.store.arrays["targets"])[train.index]
    trained = np.bincount(origin, weights=targets, minlength=len(specs))
    examples = np.bincount(origin, minlength=len(specs))
    mix = []
    for d, spec in enumerate(specs):
        mix.append({"dataset": spec.path, "examples": int(examples[d]), "tokens": int(tokens[d]),
                    "trained_tokens": int(trained[d]), "example_share": float(examples[d] / max(len(train), 1)),
                    "trained_share": float(trained[d] / max(trained.sum(), 1)),
                    "ratio": spec.ratio, "weight": spec.weight})
    return mix


def prepare_store(cfg, tokenizer, loaded: LoadedData, has_template: bool, key: str | None, root: Path,
                  write_cache: bool, warnings: list[str], keep_scratch: bool = False) -> tuple[PreparedData, Path]:
    """Tokenized SFT data in a store, and the folder holding it: a new cache entry under `key` with
    `write_cache`, else a scratch folder whose names are removed as soon as the maps are open, or, with
    `keep_scratch` (other ranks map it too: shared.py), written out whole and left for the caller to remove."""
    if key is not None and write_cache:
        with cache.staged_entry(root, key) as folder:
            prepared, meta, train, val = _build(cfg, tokenizer, loaded, has_template, folder, warnings)
            prepared.report.cache, prepared.report.cache_path = "written", str(root / key)
            cache.finish_store_entry(folder, key, meta, train, val, prepared)
        return prepared, root / key
    scratch = root / ".scratch"
    # Stores whose writers were killed before removing them (claims.py): gone before another is written.
    claims.sweep(scratch, SCRATCH)
    claim = claims.Claim(scratch, "store-")
    folder = claim.folder
    try:
        prepared, meta, train, val = _build(cfg, tokenizer, loaded, has_template, folder, warnings)
        prepared.report.cache = "fresh" if key is not None else "off"
        if keep_scratch:
            cache.finish_store_entry(folder, key or "scratch", meta, train, val, prepared)
    except BaseException:
        claim.release()
        raise
    if not keep_scratch:
        # An open map keeps its file's data after the name is gone (POSIX): nothing is left on disk, even
        # when the run is killed later. (Windows refuses to remove a mapped file: ignore_errors.)
        claim.release()
    return prepared, folder


def _build(cfg, tokenizer, loaded: LoadedData, has_template: bool, folder: Path, warnings: list[str]):
    BUILT[0] += 1
    meta, report = build_store(cfg, tokenizer, loaded, has_template, folder)
    store = TokenStore(folder, meta)
    train, val = select(cfg, store, loaded, report)
    prepared = open_prepared(store, train, val, report, [ds.spec for ds in loaded.train])
    prepared.report.warnings += warnings
    return prepared, meta, train, val
