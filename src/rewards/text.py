"""Text helpers for the built-in rewards: a completion's text, normalisation, numbers, `<answer>` tags.

Normalisation (`normalize`), used by exact_match, contains and regex-with-column:
  1. Unicode NFKC, lowercase, whitespace collapsed to single spaces, ends stripped;
  2. surrounding punctuation, brackets and quotes removed (`"Paris."` -> `paris`, `**42**` -> `42`),
     keeping a leading sign and a leading decimal point before a digit (`-5`, `.5`);
  3. a string that is then one number becomes its canonical decimal form, so numbers compare by
     value: `42`, `42.0`, `+42` -> `42`; `4,200`, `$4,200`, `4200` -> `4200`; `50%` -> `50`;
     `.50` -> `0.5`. Commas count only as thousands separators in groups of three (`1,5` is not a
     number). No scientific notation, no fractions, no LaTeX.
"""

from __future__ import annotations

import re
import unicodedata
from decimal import Decimal, InvalidOperation
from typing import Any

_QUOTES = "\"'`\u201c\u201d\u2018\u2019\u00ab\u00bb"
_LEAD = re.compile(rf"^(?:[\s{_QUOTES}()\[\]{{}}*,;:!?]|\.(?!\d))+")
_TRAIL = re.compile(rf"[\s{_QUOTES}()\[\]{{}}*,;:!?.]+$")

_DIGITS = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"
_NUMBER = re.compile(rf"[-+]?[$\u20ac\u00a3]?(?:{_DIGITS})%?")
# In running text a number must not continue a word or a dotted token: `h2o`, `v1.2` hold none.
_NUMBER_IN_TEXT = re.compile(rf"(?<![\w.])[-+]?[$\u20ac\u00a3]?(?:{_DIGITS})%?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is; for the chat shape (a list of messages, as TRL
    passes `[{"role": "assistant", "content": text}]`) the assistant messages' content joined; in a
    multi-turn exchange with tool results, the last assistant turn's (the answer given after the
    tools answered; the calls before it are not the answer). Content given as parts
    (`[{"type": "text", "text": ...}]`) contributes its text parts."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)) and all(isinstance(m, dict) for m in completion):
        if any(m.get("role") == "tool" for m in completion):
            last = [m for m in completion if m.get("role", "assistant") == "assistant"][-1:]
            return "".join(_content(m.get("content")) for m in last)
        return "".join(_content(m.get("content")) for m in completion if m.get("role", "assistant") == "assistant")
    raise TypeError(f"a completion is a string or a list of {{role, content}} messages, got {type(completion).__name__}")


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p if isinstance(p, str) else str(p.get("text", "")) for p in content
                       if isinstance(p, str) or (isinstance(p, dict) and p.get("type", "text") == "text"))
    return str(content)


def normalize(text: str) -> str:
    """The comparable form of `text` (see the module docstring)."""
    s = " ".join(unicodedata.normalize("NFKC", str(text)).lower().split())
    s = _TRAIL.sub("", _LEAD.sub("", s))
    number = parse_number(s)
    return canonical(number) if number is not None else s


def parse_number(text: str) -> Decimal | None:
    """The value of `text` if it is exactly one number (`-4,200.5`, `$12`, `50%`), else None."""
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(re.sub(r"[$\u20ac\u00a3%,+]", "", text))
    except InvalidOperation:   # the pattern admits only decimals; kept as a guard
        return None


def canonical(number: Decimal) -> str:
    """Fixed-point text with no trailing zeros: Decimal('4.20E+3') -> '4200', zero (and -0) -> '0'."""
    return "0" if number == 0 else format(number.normalize(), "f")


def numbers_in(text: str) -> list[str]:
    """Every number in running text, as written, in order."""
    return [m.group(0) for m in _NUMBER_IN_TEXT.finditer(text)]


def answer_tag(text: str) -> str | None:
    """The content of the last `<answer>...</answer>` tag, or None when there is none."""
    found = _ANSWER_TAG.findall(text)
    return found[-1] if found else None
