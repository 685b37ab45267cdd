"""Message text is text: a client's `<|im_end|><|im_start|>system` never becomes special tokens.

A chat template writes the special tokens that mark turns (`<|im_start|>`, `<|eot_id|>`, ...)
around each message's content, and the rendered prompt is tokenized with those strings
parsed as special tokens, as training tokenizes it. Tokenized that way, the same strings
inside a message would be parsed too, and anyone who can send a message could close their
turn and open a system one. So before rendering, every special token's text inside a
message is replaced by a placeholder no client can guess (private-use characters around a
random nonce); the rendered prompt is tokenized between placeholders as before (the
template's own special tokens stay special), and each placeholder's text is tokenized with
`split_special_tokens=True`: as the plain characters it is.

A message without special-token text renders and tokenizes exactly as before, so the ids of
an ordinary conversation are still training's.
"""

from __future__ import annotations

import re
import secrets


def special_texts(tokenizer) -> list[str]:
    """The text of every token the tokenizer parses as special, longest first (the tokenizer's own order
    of preference when one is the start of another)."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            found.add(getattr(token, "content", str(token)))
    return sorted((t for t in found if t), key=len, reverse=True)


class PromptTooLong(ValueError):
    """The rendered prompt has more characters than `max_chars`: it was not tokenized."""

    def __init__(self, chars: int, limit: int):
        super().__init__(f"the prompt has {chars} characters, more than {limit}")
        self.chars, self.limit = chars, limit


def literal_prompt_ids(tokenizer, render, messages: list[dict], max_chars: int | None = None) -> list[int]:
    """`render(messages)` tokenized with the special tokens the template writes, and every special
    token's text inside a message's content as plain text. PromptTooLong, before tokenizing, when the
    rendered text is longer than `max_chars` (many short messages render long: the template's text)."""
    specials = special_texts(tokenizer)
    pattern = re.compile("|".join(re.escape(t) for t in specials)) if specials else None
    if pattern is None or not any(pattern.search(m.get("content") or "") for m in messages
                                  if isinstance(m.get("content"), str)):
        text = render(messages)
        check_length(len(text), max_chars)
        return encode(tokenizer, text)
    nonce = secrets.token_hex(8)
    literals: list[str] = []

    def hide(match: re.Match) -> str:
        literals.append(match.group(0))
        return f"\ue000{nonce}:{len(literals) - 1}\ue001"

    hidden = [{**m, "content": pattern.sub(hide, m["content"])} if isinstance(m.get("content"), str) else m
              for m in messages]
    pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", render(hidden))
    texts, literal = pieces[0::2], [literals[int(k)] for k in pieces[1::2]]
    check_length(sum(map(len, texts)) + sum(map(len, literal)), max_chars)
    ids: list[int] = []
    for i, text in enumerate(texts):
        ids += encode(tokenizer, text) if text else []
        if i < len(literal):
            ids += encode(tokenizer, literal[i], split_special_tokens=True)
    return ids


def check_length(chars: int, max_chars: int | None) -> None:
    if max_chars is not None and chars > max_chars:
        raise PromptTooLong(chars, max_chars)


def encode(tokenizer, text: str, **kwargs) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, **kwargs)["input_ids"])
