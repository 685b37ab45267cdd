"""The metrics of `mudpuppy eval`: which data each reads, and how each is measured through the protocol.

    perplexity    exp(mean token NLL) over the loss-carrying tokens (the run's template and masks)
    exact_match   greedy answer equals the reference turn           } answers generated once,
    contains      the reference appears in the greedy answer        } normalised with strip and
    regex         --regex extracts the reference from the answer    } casefold (see normalize_answer)
    voice_fidelity  mean cosine similarity of the greedy answers and the references under a sentence-
                  embedding model (voice.py); reads conversations, and pairs (the chosen answer)
    preference    share of pairs whose chosen answer has the higher summed log-prob, and the mean
                  implicit-reward margin beta * (log-ratio chosen - log-ratio rejected), the ratio
                  taken against the same model with its adapter off

Each metric gives one or more table rows (`Row`); the suite asks for them by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..data import METHOD_FORMATS, PairExample
from ..data.pairs import fixed_item_batches, pair_items
from ..errors import MudpuppyError
from .heldout import heldout_loss, normalize_answer

TEXT_FORMATS = METHOD_FORMATS["sft"]                  # chat, text, instruction, completion
GENERATION_FORMATS = ("chat", "instruction", "completion")
SHOWN = 5                                             # answers (and misses) kept per model


@dataclass(frozen=True)
class Row:
    """One line of the comparison table."""

    key: str
    label: str
    style: str                # number | percent | signed
    higher_is_better: bool


@dataclass(frozen=True)
class Metric:
    name: str
    formats: tuple[str, ...]  # data formats it can read
    rows: tuple[Row, ...]


METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("perplexity", TEXT_FORMATS, (Row("perplexity", "perplexity", "number", False),)),
    Metric("exact_match", GENERATION_FORMATS, (Row("exact_match", "exact match", "percent", True),)),
    Metric("contains", GENERATION_FORMATS, (Row("contains", "contains", "percent", True),)),
    Metric("regex", GENERATION_FORMATS, (Row("regex", "regex", "percent", True),)),
    Metric("preference", ("preference",), (Row("preference_accuracy", "preference accuracy", "percent", True),
                                           Row("reward_margin", "reward margin", "signed", True))),
    Metric("voice_fidelity", GENERATION_FORMATS + ("preference",),
           (Row("voice_fidelity", "voice fidelity", "number", True),)),
)}
GENERATION = ("exact_match", "contains", "regex")
ANSWERING = GENERATION + ("voice_fidelity",)          # metrics that need the model's greedy answers


def parse_metrics(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METRICS]
    if unknown or not names:
        raise MudpuppyError(f"--metrics: unknown metric {', '.join(map(repr, unknown)) or '(none given)'}; "
                            f"choose from {', '.join(METRICS)} (comma-separated)")
    return list(dict.fromkeys(names))


def default_metrics(fmt: str, regex: str | None) -> list[str]:
    """What a data format supports, when --metrics is not given."""
    if fmt in GENERATION_FORMATS:
        return ["perplexity", "exact_match"] + (["regex"] if regex else [])
    return [name for name, m in METRICS.items() if fmt in m.formats and name not in ANSWERING]


def check_metrics(metrics: list[str], fmt: str, where: str, regex: str | None) -> None:
    """Every metric must read this data format; regex needs its pattern. Raised before any model loads."""
    for name in metrics:
        if fmt not in METRICS[name].formats:
            fits = [n for n, m in METRICS.items() if fmt in m.formats]
            fits_text = f"metrics that read {fmt} data: {', '.join(fits)}" if fits else f"no metric reads {fmt} data"
            raise MudpuppyError(f"--metrics {name}: {where} holds {fmt} records, and {name} needs "
                                f"{' or '.join(METRICS[name].formats)} data ({fits_text})")
    if "regex" in metrics and not regex:
        raise MudpuppyError("--metrics regex: give the pattern with --regex PATTERN (its first group, or the whole "
                            "match, is compared with the reference)")
    if regex:
        try:
            re.compile(regex)
        except re.error as exc:
            raise MudpuppyError(f"--regex {regex!r}: not a valid regular expression ({exc})") from None


def rows_for(metrics: list[str]) -> list[Row]:
    return [row for name in metrics for row in METRICS[name].rows]


# --------------------------------------------------------------------------- measuring

def perplexity(backend, handle, examples: list, batch_size: int) -> dict:
    loss, ppl = heldout_loss(backend, handle, examples, batch_size)
    tokens = sum(int(ex.loss_mask[1:].sum()) for ex in examples)   # token 0 is never a target
    return {"perplexity": ppl, "nll": loss, "tokens": tokens}


@dataclass(frozen=True)
class Scoring:
    """How answers compare with references."""

    strip: bool = True
    casefold: bool = True
    regex: str | None = None

    def normalize(self, text: str) -> str:
        return normalize_answer(text, self.strip, self.casefold)


def generation_scores(answers: list[tuple[str, str]], metrics: list[str],
                      scoring: Scoring) -> tuple[dict, list[dict], list[dict]]:
    """Each generation metric's share of hits over (reference, answer) pairs; the first answers,
    and the first that missed any of the metrics."""
    pattern = re.compile(scoring.regex, re.DOTALL) if "regex" in metrics else None
    wanted = [m for m in GENERATION if m in metrics]
    hits = dict.fromkeys(wanted, 0)
    shown, missed = [], []
    for ref, answer in answers:
        r, a = scoring.normalize(ref), scoring.normalize(answer)
        got = {"exact_match": a == r, "contains": r in a}
        if pattern is not None:
            found = pattern.search(answer)
            value = (found.group(1) if pattern.groups else found.group(0)) if found else None
            got["regex"] = value is not None and scoring.normalize(value) == r
        for m in wanted:
            hits[m] += bool(got[m])
        row = {"reference": ref, "answer": answer, **{m: bool(got[m]) for m in wanted}}
        if len(shown) < SHOWN:
            shown.append(row)
        if len(missed) < SHOWN and not all(got[m] for m in wanted):
            missed.append(row)
    return {m: hits[m] / max(len(answers), 1) for m in wanted}, shown, missed


def preference_scores(backend, handle, pairs: list[PairExample], batch_size: int, beta: float,
                      reference: bool) -> dict:
    """Preference accuracy (summed log-prob of chosen above rejected) and, with `reference` (the model
    has an adapter to switch off), the mean implicit-reward margin beta * (log-ratio chosen - rejected)."""
    chosen, rejected, margins = [], [], []
    for batch in fixed_item_batches(pair_items(pairs), batch_size, handle.tokenizer.pad_token_id):
        n = batch.size          # rows are role-major: the batch's chosen sequences, then its rejected ones
        logps, _ = backend.sequence_logprobs(handle, batch.batch, grad=False)
        logps = backend.ops.to_numpy(logps).astype(np.float64)
        chosen.append(logps[:n])
        rejected.append(logps[n:])
        if reference:
            ref = backend.ops.to_numpy(backend.reference_logprobs(handle, batch.batch)).astype(np.float64)
            margins.append(beta * ((logps[:n] - ref[:n]) - (logps[n:] - ref[n:])))
    c, r = np.concatenate(chosen), np.concatenate(rejected)
    margin = float(np.concatenate(margins).mean()) if reference else None
    return {"preference_accuracy": float((c > r).mean()), "reward_margin": margin, "pairs": len(pairs),
            "chosen_logp": float(c.mean()), "rejected_logp": float(r.mean())}
