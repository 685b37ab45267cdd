"""The built-in reward functions. `BUILTINS[name](**options)` returns one, called the TRL way:

    reward(prompts=..., completions=..., completion_ids=..., **columns) -> list[float | None]

Completions may be strings or chat-shaped (`[{"role": "assistant", "content": text}]`). A row whose
reference is None (or normalises to nothing) scores None: "not applicable", left out of that
function's mean. A reference may also be a list of acceptable answers: any one counts.

    exact_match  1.0 when the answer equals the reference, else 0.0. The answer text is the content
                 of the last <answer>...</answer> tag when the completion has one, else the whole
                 completion; it matches when the answer text itself, or the last number in it, equals
                 the reference (with normalize: true, after rewards/text.py's normalisation, so
                 numbers compare by value; with normalize: false, after stripping only).
                 A completion that equals the reference as a whole also matches.
    contains     1.0 when the reference appears in the completion. A numeric reference must equal one
                 of the numbers in the completion (so 42 is not found in 1420); any other reference is
                 a substring test, both sides normalised (normalize: false: case-sensitive, as is).
    regex        without column: 1.0 when the pattern is found anywhere. With column: the first
                 match's first group (the whole match if the pattern has no group) must equal the
                 column's value after normalisation; no match scores 0.0.
    format       1.0 when the whole completion, ends stripped of whitespace, matches the pattern
                 (re.fullmatch), else 0.0.
    length       max(0, 1 - |length - target| / target), length in completion tokens (unit: tokens,
                 from completion_ids) or characters (unit: chars).

Patterns are compiled with re.DOTALL (`.` crosses newlines); inline flags such as (?i) work.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .text import answer_tag, completion_text, normalize, numbers_in, parse_number

RewardFn = Callable[..., list]

# Each factory takes the built-in's options (rewards/options.py) as keyword arguments and returns a
# function named like the built-in, so tracebacks read `exact_match`. Inside exact_match_reward and
# contains_reward, `normalize` is the option (a bool); the helpers use text.normalize.


def _references(columns: dict, column: str, who: str, count: int) -> list[list[str] | None]:
    """Each row's acceptable answers as strings, or None where the row has no reference."""
    if column not in columns:
        raise ValueError(f"{who} reads the column '{column}', which was not passed "
                         f"(columns: {', '.join(sorted(columns)) or 'none'})")
    values = columns[column]
    if len(values) != count:
        raise ValueError(f"{who}: column '{column}' has {len(values)} values for {count} completions")
    return [None if v is None else [str(x) for x in (v if isinstance(v, (list, tuple)) else [v]) if x is not None]
            for v in values]


def _wanted(refs: list[str] | None, key: Callable[[str], str]) -> set[str]:
    return {key(r) for r in refs or ()} - {""}


def _exact(text: str, refs: list[str] | None, normalized: bool) -> float | None:
    key = normalize if normalized else str.strip
    wanted = _wanted(refs, key)
    if not wanted:
        return None
    answer = answer_tag(text)
    answer = text if answer is None else answer
    candidates = {key(text), key(answer)}
    found = numbers_in(answer)
    if found:
        candidates.add(key(found[-1]))
    return 1.0 if candidates & wanted else 0.0


def _contains(text: str, refs: list[str] | None, normalized: bool) -> float | None:
    key = normalize if normalized else str.strip
    wanted = _wanted(refs, key)
    if not wanted:
        return None
    if not normalized:
        return 1.0 if any(w in text for w in wanted) else 0.0
    numbers = {normalize(n) for n in numbers_in(text)}
    body = normalize(text)
    hit = any((w in numbers) if parse_number(w) is not None else (w in body) for w in wanted)
    return 1.0 if hit else 0.0


def exact_match_reward(column: str = "answer", normalize: bool = True) -> RewardFn:
    def exact_match(prompts=None, completions=(), completion_ids=None, **columns: Any) -> list:
        refs = _references(columns, column, "exact_match", len(completions))
        return [_exact(completion_text(c), r, normalize) for c, r in zip(completions, refs)]
    return exact_match


def contains_reward(column: str = "answer", normalize: bool = True) -> RewardFn:
    def contains(prompts=None, completions=(), completion_ids=None, **columns: Any) -> list:
        refs = _references(columns, column, "contains", len(completions))
        return [_contains(completion_text(c), r, normalize) for c, r in zip(completions, refs)]
    return contains


def regex_reward(pattern: str, column: str | None = None) -> RewardFn:
    compiled = re.compile(pattern, re.DOTALL)

    def captured(text: str, refs: list[str] | None) -> float | None:
        wanted = _wanted(refs, normalize)
        if not wanted:
            return None
        m = compiled.search(text)
        value = (m.group(1) if compiled.groups else m.group(0)) if m else None
        return 1.0 if value is not None and normalize(value) in wanted else 0.0

    def regex(prompts=None, completions=(), completion_ids=None, **columns: Any) -> list:
        texts = [completion_text(c) for c in completions]
        if column is None:
            return [1.0 if compiled.search(t) else 0.0 for t in texts]
        return [captured(t, r) for t, r in zip(texts, _references(columns, column, "regex", len(texts)))]
    return regex


def format_reward(pattern: str) -> RewardFn:
    compiled = re.compile(pattern, re.DOTALL)

    def format(prompts=None, completions=(), completion_ids=None, **columns: Any) -> list:
        return [1.0 if compiled.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]
    return format


def length_reward(target: int, unit: str = "tokens") -> RewardFn:
    def length(prompts=None, completions=(), completion_ids=None, **columns: Any) -> list:
        if unit == "tokens":
            if completion_ids is None:
                raise ValueError("length with unit tokens counts completion_ids, and none were passed")
            sizes = [len(ids) for ids in completion_ids]
        else:
            sizes = [len(completion_text(c)) for c in completions]
        return [max(0.0, 1.0 - abs(n - target) / target) for n in sizes]
    return length


BUILTINS: dict[str, Callable[..., RewardFn]] = {
    "exact_match": exact_match_reward, "contains": contains_reward, "regex": regex_reward,
    "format": format_reward, "length": length_reward,
}
