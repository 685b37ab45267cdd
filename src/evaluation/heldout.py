"""Held-out loss and exact-match accuracy, measured through the backend protocol."""

from __future__ import annotations

import math

from ..data import fixed_batches, generation_prompt
from ..data.prepare import EVAL_TOOL_FORMAT
from .result import EvalResult     # defined apart since issue 27 (every method's result); imported from here too


def heldout_loss(backend, handle, examples, batch_size: int) -> tuple[float, float]:
    pad = handle.tokenizer.pad_token_id
    total, count = backend.evaluate_loss(handle, fixed_batches(examples, batch_size, pad))
    loss = total / max(count, 1)
    return loss, math.exp(min(loss, 50.0))


# End-of-turn markers of the built-in chat templates (chatml, llama3, gemma, phi3).
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


def stop_token_ids(tokenizer) -> list[int]:
    """EOS plus whichever end-of-turn markers this vocabulary really has.

    convert_tokens_to_ids maps an unknown token to the unk id, which must not
    become a stop token, so markers are looked up in the vocabulary itself.
    """
    vocab = tokenizer.get_vocab()
    ids = {vocab[t] for t in END_OF_TURN if t in vocab}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def normalize_answer(text: str, strip: bool = True, casefold: bool = True) -> str:
    """`strip`: ends trimmed and runs of whitespace made one space; `casefold`: case ignored."""
    if strip:
        text = " ".join(text.split())
    return text.casefold() if casefold else text


def generate_answers(backend, handle, records: list[dict], max_new_tokens: int,
                     batch_size: int) -> list[tuple[str, str]]:
    """(reference, greedy answer) for each chat record, in record order. The prompt is the
    conversation up to its last assistant turn, rendered with the tokenizer's chat template;
    that turn's text is the reference."""
    tok = handle.tokenizer
    stop = stop_token_ids(tok)
    pairs = [generation_prompt(tok, r["messages"], r.get("tools"), r.get(EVAL_TOOL_FORMAT, "template"))
             for r in records]
    answers = [""] * len(pairs)
    # Shortest prompts together: less left-padding per generation batch.
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        outputs = backend.generate(handle, [pairs[i][0] for i in idx], max_new_tokens, stop)
        for i, out in zip(idx, outputs):
            answers[i] = tok.decode(out, skip_special_tokens=True)
    return [(ref, answer) for (_, ref), answer in zip(pairs, answers)]


def exact_match(backend, handle, records: list[dict], max_new_tokens: int, batch_size: int) -> tuple[float, list[dict]]:
    """Share of chat records whose greedy answer equals the reference (whitespace and case folded)."""
    answers = generate_answers(backend, handle, records, max_new_tokens, batch_size)
    hits, shown = 0, []
    for ref, pred in answers:
        ok = normalize_answer(pred) == normalize_answer(ref)
        hits += ok
        if len(shown) < 5:
            shown.append({"reference": ref, "prediction": pred, "match": bool(ok)})
    return hits / max(len(answers), 1), shown


def evaluate(backend, handle, data, eval_cfg) -> EvalResult:
    result = EvalResult()
    val = data.val[: eval_cfg.max_samples] if eval_cfg.max_samples else data.val
    records = data.val_records[: len(val)]
    result.samples = len(val)
    if not val:
        return result
    if eval_cfg.loss:
        result.loss, result.perplexity = heldout_loss(backend, handle, val, eval_cfg.batch_size)
    if eval_cfg.exact_match and records and "messages" in records[0]:
        result.exact_match, result.examples = exact_match(
            backend, handle, records, eval_cfg.max_new_tokens, eval_cfg.batch_size)
    return result
