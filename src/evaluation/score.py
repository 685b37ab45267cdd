"""`mudpuppy score`: a trained reward model's scores for every record of a file.

Records are tokenized exactly as training tokenized them (same chat
template, same rendering), so a score here is the score the model learnt.
Reward models score {"text"} / {"text", "label"} records, chat
conversations and prompt/completion records one score each, and preference
pairs one score per side; process reward models give each step of a
{"prompt", "completions", "labels"} record the probability that it is right.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import DatasetSpec
from ..data import Example, LabeledExample, PairExample, StepExample, collate
from ..data.pairs import collate_steps
from ..data.prepare import load_dataset, tokenize_dataset
from ..data.templates import apply_chat_template_choice
from ..errors import DataError, MudpuppyError

HEADS = {"rm": "sequence_classification", "prm": "token_classification"}
BATCH = 16


@dataclass
class Scored:
    rows: list[dict]          # one per record, in file order
    summary: str


def score_file(cfg, backend, path: str) -> Scored:
    if cfg.method not in HEADS:
        raise MudpuppyError(f"mudpuppy score needs a reward model config (method: rm or prm); "
                            f"this one has method: {cfg.method}")
    out = Path(cfg.output_dir)
    if not (out / "config.json").is_file():
        raise MudpuppyError(f"{out} holds no trained model (no config.json); train it first: "
                            "mudpuppy run --config ...")
    handle = backend.load_model(cfg.model.model_copy(update={"base_model": str(out), "tokenizer": None}),
                                "fp32", head=HEADS[cfg.method])
    ds = load_dataset(cfg, DatasetSpec(path=path))
    template = apply_chat_template_choice(handle.tokenizer, cfg.data.chat_template)
    examples, _ = tokenize_dataset(ds, handle.tokenizer, template is not None)
    examples = [ex.truncated(cfg.data.sequence_len) for ex in examples]
    if cfg.method == "prm":
        return score_steps(backend, handle, examples, ds.name)
    return score_sequences(backend, handle, examples)


def sequence_scores(backend, handle, sequences: list[Example]) -> np.ndarray:
    pad = handle.tokenizer.pad_token_id
    out = []
    for start in range(0, len(sequences), BATCH):
        batch = collate(sequences[start : start + BATCH], pad)
        out.append(backend.ops.to_numpy(backend.sequence_scores(handle, batch, grad=False)))
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def score_sequences(backend, handle, examples: list) -> Scored:
    sequences = [s for ex in examples for s in ex.sequences()]
    scores = iter(sequence_scores(backend, handle, sequences).tolist())
    rows, wins, pairs, errors = [], 0, 0, []
    for ex in examples:
        if isinstance(ex, PairExample):
            chosen, rejected = next(scores), next(scores)
            pairs += 1
            wins += chosen > rejected
            rows.append({"source": ex.source, "chosen": round(chosen, 6), "rejected": round(rejected, 6),
                         "chosen_wins": chosen > rejected})
            continue
        score = next(scores)
        row = {"source": ex.source, "score": round(score, 6)}
        if isinstance(ex, LabeledExample) and not isinstance(ex.label, bool):
            row["label"] = ex.label
            errors.append((score - ex.label) ** 2)
        rows.append(row)
    parts = [f"scored {len(rows)} records"]
    if pairs:
        parts.append(f"chosen scored higher in {wins} of {pairs} pairs ({wins / pairs:.1%})")
    if errors:
        parts.append(f"mean squared error against the labels {float(np.mean(errors)):.4f}")
    return Scored(rows, "; ".join(parts))


def score_steps(backend, handle, examples: list, name: str) -> Scored:
    if not all(isinstance(ex, StepExample) for ex in examples):
        raise DataError(name, None, "a process reward model scores {prompt, completions, labels} records")
    pad = handle.tokenizer.pad_token_id
    rows, right, total = [], 0, 0
    for start in range(0, len(examples), BATCH):
        chunk = examples[start : start + BATCH]
        batch = collate_steps(chunk, pad)
        logits = backend.ops.to_numpy(backend.token_scores(handle, batch.batch, grad=False))
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = (probs / probs.sum(axis=1, keepdims=True))[:, 1]
        at = 0
        for ex in chunk:
            n = int(ex.example.loss_mask.sum())
            p = probs[at : at + n]
            at += n
            right += int(((p > 0.5) == ex.step_labels[:n]).sum())
            total += n
            rows.append({"source": ex.source, "step_scores": [round(float(v), 6) for v in p],
                         "labels": [bool(v) for v in ex.step_labels[:n]]})
    return Scored(rows, f"scored {len(rows)} records, {total} steps; step accuracy {right / max(total, 1):.1%}")
