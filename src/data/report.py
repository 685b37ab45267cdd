"""What the data looks like once tokenized: counts, lengths, loss share, packing, samples.

`mudpuppy preprocess` prints this; the numbers are computed from prepared
data alone, so a cached run reports exactly what a fresh one would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batching import Batcher, lengths_of
from .examples import Example
from .packing import packing_efficiency
from .prepare import PreparedData
from .shared import describe_sharing

PERCENTILES = (50, 90, 99)
OPEN, CLOSE = "[[", "]]"     # around loss-carrying tokens in decoded samples


@dataclass
class LengthStats:
    count: int
    tokens: int
    minimum: int
    maximum: int
    mean: float
    percentiles: dict[int, int]


def length_stats(examples) -> LengthStats | None:
    # A store view knows its lengths as one array; other example types count every sequence.
    known = getattr(examples, "lengths", None)
    lengths = np.asarray(known if known is not None else [len(s) for ex in examples for s in ex.sequences()])
    if not len(lengths):
        return None
    pct = {p: int(np.percentile(lengths, p, method="nearest")) for p in PERCENTILES}
    return LengthStats(len(examples), int(lengths.sum()), int(lengths.min()), int(lengths.max()),
                       float(lengths.mean()), pct)


def batching_efficiency(examples, cfg, pad_id: int) -> tuple[float, int]:
    """(share of batch slots holding real tokens, batches per epoch) under the config's batching."""
    real, slots, batches = Batcher.from_config(examples, cfg, pad_id).epoch_fill()
    return real / max(slots, 1), batches


def describe_batching(cfg) -> str:
    d, t = cfg.data, cfg.training
    if d.packing:
        per = f"{d.tokens_per_batch // d.sequence_len} rows" if d.tokens_per_batch else f"{t.micro_batch_size} rows"
        return f"packed rows of {d.sequence_len}, {per} per batch"
    if d.tokens_per_batch:
        return f"token budget {d.tokens_per_batch} per batch, grouped by length"
    grouped = ", grouped by length" if d.group_by_length else ""
    return f"micro_batch_size {t.micro_batch_size}, padded{grouped}"


def mark_loss_tokens(tokenizer, ex: Example) -> str:
    """Decoded text with each run of loss-carrying tokens wrapped in [[ ]]."""
    parts, start = [], 0
    ids, mask = ex.input_ids.tolist(), ex.loss_mask.tolist()
    for t in range(1, len(ids) + 1):
        if t == len(ids) or mask[t] != mask[start]:
            text = tokenizer.decode(ids[start:t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            parts.append(f"{OPEN}{text}{CLOSE}" if mask[start] else text)
            start = t
    return "".join(parts)


def plain_examples(train):
    """The examples packing and batching apply to: a store view whole; of a list, its plain Examples."""
    if hasattr(train, "lengths"):
        return train
    return [ex for ex in train if isinstance(ex, Example)]


def mix_lines(rep) -> list[str]:
    """The training mix as realised, one line per dataset, where there is a mix: several datasets, or a weight."""
    if len(rep.mix) < 2 and not any(m["weight"] not in (None, 1) for m in rep.mix):
        return []
    lines = ["training mix (per dataset: examples, share of examples, tokens, share of trained tokens):"]
    for m in rep.mix:
        asked = (f"ratio {m['ratio']:g}" if m["ratio"] is not None
                 else f"weight {m['weight']:g}" if m["weight"] is not None else "whole")
        lines.append(f"  {m['dataset']}: {m['examples']} examples ({m['example_share']:.1%}; {asked}), "
                     f"{m['tokens']:,} tokens, {m['trained_share']:.1%} of trained tokens")
    return lines


def run_lines(rep) -> list[str]:
    """What a run prints about its data beyond its one-line summary: the mix, and in a distributed run which
    ranks tokenized the one store they all map."""
    sharing = describe_sharing(rep)
    return mix_lines(rep) + ([sharing] if sharing else [])


def format_report(prepared: PreparedData, cfg, tokenizer, samples: int = 0) -> list[str]:
    rep = prepared.report
    lines = []
    for path, n in rep.per_dataset.items():
        tools = rep.tool_formats.get(path)
        shown = f", tool calls written by {'the chat template' if tools == 'template' else tools}" if tools else ""
        lines.append(f"  {path}: {rep.formats.get(path, '?')}, {n} examples{shown}")
    lines.append(f"train: {rep.train_examples} examples; validation: {rep.val_examples} examples")
    for label, exs in (("train", prepared.train), ("validation", prepared.val)):
        st = length_stats(exs)
        if st is None:
            continue
        pct = "  ".join(f"p{p} {v}" for p, v in st.percentiles.items())
        lines.append(f"{label} tokens: {st.tokens:,}; per sequence: min {st.minimum}  {pct}  max {st.maximum}  "
                     f"(mean {st.mean:.1f}, sequence_len {cfg.data.sequence_len})")
    lines.append(f"truncated: {rep.truncated}; dropped: {rep.dropped} ({rep.dropped_too_long} too long, "
                 f"{rep.dropped_no_target} with no trained tokens); bad records skipped: {rep.skipped}")
    for where in rep.skipped_at:
        lines.append(f"  skipped {where}")
    lines.append(f"loss-carrying tokens: {rep.loss_token_share:.1%} of training tokens")
    lines += run_lines(rep)
    plain = plain_examples(prepared.train)
    if len(plain):
        eff, rows = packing_efficiency(lengths_of(plain), cfg.data.sequence_len)
        lines.append(f"packing: {eff:.1%} of slots filled ({rows} rows of {cfg.data.sequence_len})"
                     + ("" if cfg.data.packing else "  [data.packing is off]"))
        eff, n = batching_efficiency(plain, cfg, tokenizer.pad_token_id or 0)
        lines.append(f"batching ({describe_batching(cfg)}): {n} batches per epoch, {eff:.1%} of slots are real tokens")
    lines += [f"warning: {w}" for w in rep.warnings]
    for i, ex in enumerate(prepared.train[:samples], start=1):
        for j, seq in enumerate(ex.sequences()):
            tag = "" if len(ex.sequences()) == 1 else (" chosen" if j == 0 else " rejected")
            lines.append(f"--- sample {i}{tag} ({seq.source}); loss-carrying tokens in {OPEN} {CLOSE}")
            lines.append(mark_loss_tokens(tokenizer, seq))
    return lines
