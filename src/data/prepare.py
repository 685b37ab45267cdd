"""Config to tokenized train/validation sets: the one entry point pipelines call."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import DataError
from .records import load_records
from .tokenize import Example, require_chat_template, tokenize_chat, tokenize_text


@dataclass
class DataReport:
    per_dataset: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    dropped: int = 0
    train_examples: int = 0
    val_examples: int = 0
    loss_token_share: float = 0.0


@dataclass
class PreparedData:
    train: list[Example]
    val: list[Example]
    val_records: list[dict]       # raw records behind `val`, for generation checks
    report: DataReport


def _tokenize_file(cfg, spec, tokenizer) -> tuple[list[Example], list[dict]]:
    path = cfg.resolve_path(spec.path)
    fmt, records = load_records(path)
    if spec.type not in ("auto", fmt):
        raise DataError(str(path), None, f"declared type {spec.type!r} but the records are {fmt!r} format")
    roles = set(spec.roles_to_train)
    examples, kept = [], []
    if fmt == "chat":
        require_chat_template(tokenizer, str(path))
    for lineno, record in records[: spec.num_samples]:
        source = f"{path}:{lineno}"
        if fmt == "chat":
            ex = tokenize_chat(tokenizer, record["messages"], roles, source)
        else:
            ex = tokenize_text(tokenizer, record["text"], source)
        examples.append(ex)
        kept.append(record)
    return examples, kept


def _fit_length(examples, records, max_len: int, policy: str, report: DataReport):
    out_ex, out_rec = [], []
    for ex, rec in zip(examples, records):
        if len(ex) > max_len:
            if policy == "drop":
                report.dropped += 1
                continue
            report.truncated += 1
            ex = Example(ex.input_ids[:max_len], ex.loss_mask[:max_len], ex.source)
        if ex.loss_mask[1:].any():   # an example with no target teaches nothing
            out_ex.append(ex)
            out_rec.append(rec)
        else:
            report.dropped += 1
    return out_ex, out_rec


def prepare_sft_data(cfg, tokenizer) -> PreparedData:
    report = DataReport()
    train, train_rec = [], []
    for spec in cfg.data.datasets:
        ex, rec = _tokenize_file(cfg, spec, tokenizer)
        report.per_dataset[spec.path] = len(ex)
        train += ex
        train_rec += rec
    train, train_rec = _fit_length(train, train_rec, cfg.data.sequence_len, cfg.data.truncation, report)

    val, val_rec = [], []
    for spec in cfg.data.val_datasets:
        ex, rec = _tokenize_file(cfg, spec, tokenizer)
        report.per_dataset[spec.path] = len(ex)
        val += ex
        val_rec += rec
    val, val_rec = _fit_length(val, val_rec, cfg.data.sequence_len, cfg.data.truncation, report)

    size = cfg.data.val_set_size
    if size and not cfg.data.val_datasets:
        n_val = int(size) if size >= 1 else max(1, round(len(train) * size))
        if n_val >= len(train):
            raise DataError("data.val_set_size", None, f"holds out {n_val} of {len(train)} examples, leaving none to train on")
        order = np.random.default_rng(cfg.training.seed).permutation(len(train))
        held = set(order[:n_val].tolist())
        val = [train[i] for i in sorted(held)]
        val_rec = [train_rec[i] for i in sorted(held)]
        train = [train[i] for i in range(len(train)) if i not in held]
    if not train:
        raise DataError(cfg.data.datasets[0].path, None, "no usable training examples after length filtering")

    report.train_examples, report.val_examples = len(train), len(val)
    total = sum(len(e) for e in train)
    report.loss_token_share = sum(int(e.loss_mask.sum()) for e in train) / max(total, 1)
    return PreparedData(train, val, val_rec, report)
