"""How long a prompt may be, for `chat` and `serve` alike: the model's context in tokens, and before any
tokenizing, in characters (tokenizing 15 MB takes minutes and gigabytes; a message that cannot fit is
refused before that cost)."""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.decoding import context_length
from .literal import PromptTooLong


class ContextExceeded(ValueError):
    """The prompt does not fit the model's context: `str()` names the limit and what the prompt holds."""

    def __init__(self, context: int, detail: str):
        super().__init__(f"This model's maximum context length is {context} tokens. However, {detail}.")
        self.context = context


def prompt_char_limit(tokenizer, context: int | None) -> int | None:
    """The most characters the messages of a prompt that fits `context` tokens can hold: no token stands
    for more characters than the longest in the vocabulary (byte-level vocabularies write a byte as one
    character, and a character is at least one byte), so longer messages need more tokens than the
    context has."""
    if context is None:
        return None
    try:
        longest = max(map(len, tokenizer.get_vocab()), default=0)
    except Exception:      # a tokenizer without a vocabulary to list: the body limit alone bounds the prompt
        return None
    return context * max(longest, 1)


@dataclass(frozen=True)
class PromptBound:
    context: int | None        # tokens; None: the model does not say
    chars: int | None          # characters of messages, checked before tokenizing

    @classmethod
    def of(cls, model) -> PromptBound:
        context = context_length(model.handle)
        return cls(context, prompt_char_limit(model.tokenizer, context))

    def prompt_ids(self, model, messages: list[dict]) -> list[int]:
        """The prompt's ids, or ContextExceeded: by characters before rendering (the messages' text), after
        rendering (many short messages pass the first check; the template's text counts too), then by
        tokens (a prompt that fills the context leaves no room for an answer)."""
        chars = sum(len(m["content"]) for m in messages)
        if self.chars is not None and chars > self.chars:
            raise self.too_many_chars("messages hold", chars)
        try:
            prompt = model.prompt_ids(messages, self.chars)
        except PromptTooLong as exc:
            raise self.too_many_chars("rendered messages have", exc.chars) from None
        if self.context is not None and len(prompt) >= self.context:
            raise ContextExceeded(self.context, f"your messages resulted in {len(prompt)} tokens")
        return prompt

    def too_many_chars(self, what: str, chars: int) -> ContextExceeded:
        return ContextExceeded(self.context, f"your {what} {chars} characters, more than {self.context} tokens can "
                                             f"hold ({self.chars})")
