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


def literal_prompt_ids(tokenizer, render, messages: list[dict]) -> list[int]:
    """`render(messages)` tokenized with the special tokens the template writes, and every special
    token's text inside a message's content as plain text."""
    specials = special_texts(tokenizer)
    pattern = re.compile("|".join(re.escape(t) for t in specials)) if specials else None
    if pattern is None or not any(pattern.search(m.get("content") or "") for m in messages
                                  if isinstance(m.get("content"), str)):
        return encode(tokenizer, render(messages))
    nonce = secrets.token_hex(8)
    literals: list[str] = []

    def hide(match: re.Match) -> str:
        literals.append(match.group(0))
        return f"\ue000{nonce}:{len(literals) - 1}\ue001"

    hidden = [{**m, "content": pattern.sub(hide, m["content"])} if isinstance(m.get("content"), str) else m
              for m in messages]
    pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", render(hidden))
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            ids += encode(tokenizer, piece) if piece else []
        else:
            ids += encode(tokenizer, literals[int(piece)], split_special_tokens=True)
    return ids


def encode(tokenizer, text: str, **kwargs) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, **kwargs)["input_ids"])
