"""Records to token arrays with loss masks, using the tokenizer's chat template.

Loss masks are found from character spans: the chat template renders the
conversation once, each trained turn's span is the text the template adds for
that turn, and a token carries loss when it starts inside such a span. This
keeps the turn's closing marker (e.g. ``<|im_end|>``) in the loss, so the model
learns to stop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import DataError


@dataclass
class Example:
    input_ids: np.ndarray      # int32 [T]
    loss_mask: np.ndarray      # bool  [T]; True where the token is a training target
    source: str = ""           # file:line, for reports

    def __len__(self) -> int:
        return len(self.input_ids)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def require_chat_template(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            where, None,
            "chat data needs a chat template, and this tokenizer has none; "
            "set data.chat_template to a built-in template, or use a tokenizer that ships one",
        )


def trained_spans(tokenizer, messages: list[dict], roles: set[str]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of turns whose role is trained."""
    full = render_chat(tokenizer, messages)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] not in roles or msg.get("train") is False:
            continue
        before = render_chat(tokenizer, messages[:i], add_generation_prompt=msg["role"] == "assistant") if i else ""
        upto = render_chat(tokenizer, messages[: i + 1])
        if not full.startswith(upto) or not upto.startswith(before):
            raise DataError("chat template", None, "the chat template does not render conversations as a growing prefix; masks cannot be derived from it")
        spans.append((len(before), len(upto)))
    return full, spans


def tokenize_chat(tokenizer, messages: list[dict], roles: set[str], source: str = "") -> Example:
    text, spans = trained_spans(tokenizer, messages, roles)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    mask = np.zeros(len(ids), dtype=bool)
    for t, (start, end) in enumerate(enc["offset_mapping"]):
        if end > start:
            mask[t] = any(lo <= start < hi for lo, hi in spans)
    return Example(ids, mask, source)


def tokenize_text(tokenizer, text: str, source: str = "") -> Example:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        ids = list(ids) + [tokenizer.eos_token_id]
    ids = np.asarray(ids, dtype=np.int32)
    return Example(ids, np.ones(len(ids), dtype=bool), source)


def generation_prompt(tokenizer, messages: list[dict]) -> tuple[list[int], str]:
    """Prompt ids up to the last assistant turn, and that turn's text (the reference answer)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise ValueError("a conversation with no assistant turn has no reference answer")
    text = render_chat(tokenizer, messages[:last], add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(ids), messages[last]["content"]
