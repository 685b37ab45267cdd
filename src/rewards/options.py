"""The built-in reward functions' options: defaults, required keys, the shorthand scalar, checks.

Pure Python (only `re`), because config validation runs it. Options are written either as a
mapping or as one scalar that stands for the main option:

    exact_match   column ("answer"), normalize (true)        shorthand: {exact_match: solution} = column
    contains      column ("answer"), normalize (true)        shorthand: {contains: solution}    = column
    regex         pattern (required), column (none)          shorthand: {regex: "..."}          = pattern
    format        pattern (required)                         shorthand: {format: "..."}         = pattern
    length        target (required), unit ("tokens"|"chars") shorthand: {length: 200}          = target

Patterns are compiled here (with re.DOTALL, as the rewards use them), so a bad one is a config error.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REQUIRED = object()


@dataclass(frozen=True)
class Option:
    default: Any
    check: Callable[[Any], str | None]   # the problem with a value, or None when it is fine


def _column(v: Any) -> str | None:
    return None if isinstance(v, str) and v.strip() else f"expected a column name (a string), got {v!r}"


def _optional_column(v: Any) -> str | None:
    return None if v is None else _column(v)


def _flag(v: Any) -> str | None:
    return None if isinstance(v, bool) else f"expected true or false, got {v!r}"


def _pattern(v: Any) -> str | None:
    if not isinstance(v, str) or not v:
        return f"expected a regular expression (a string), got {v!r}"
    try:
        re.compile(v, re.DOTALL)
    except re.error as exc:
        return f"not a valid regular expression ({exc}): {v!r}"
    return None


def _positive_int(v: Any) -> str | None:
    ok = isinstance(v, int) and not isinstance(v, bool) and v > 0
    return None if ok else f"expected a whole number above 0, got {v!r}"


def _unit(v: Any) -> str | None:
    return None if v in ("tokens", "chars") else f"expected 'tokens' or 'chars', got {v!r}"


BUILTIN_OPTIONS: dict[str, dict[str, Option]] = {
    "exact_match": {"column": Option("answer", _column), "normalize": Option(True, _flag)},
    "contains": {"column": Option("answer", _column), "normalize": Option(True, _flag)},
    "regex": {"pattern": Option(REQUIRED, _pattern), "column": Option(None, _optional_column)},
    "format": {"pattern": Option(REQUIRED, _pattern)},
    "length": {"target": Option(REQUIRED, _positive_int), "unit": Option("tokens", _unit)},
}
SHORTHAND = {"exact_match": "column", "contains": "column", "regex": "pattern", "format": "pattern",
             "length": "target"}
EXAMPLES = {
    "regex": '{regex: "<answer>"} or {regex: {pattern: "<answer>(.*?)</answer>", column: answer}}',
    "format": '{format: "<think>.*?</think>\\s*<answer>.*?</answer>"}',
    "length": "{length: 200} or {length: {target: 800, unit: chars}}",
}
BUILTIN_NAMES = tuple(BUILTIN_OPTIONS)


def builtin_options(name: str, value: Any) -> tuple[dict[str, Any], list[str]]:
    """Options as written (None, a shorthand scalar or a mapping) -> (every option, defaults filled in; problems)."""
    if value is None:
        value = {}
    elif not isinstance(value, dict):
        value = {SHORTHAND[name]: value}
    schema = BUILTIN_OPTIONS[name]
    problems = [f"{name}: unknown option '{key}' (its options: {', '.join(schema)})"
                for key in value if key not in schema]
    options = {}
    for key, option in schema.items():
        if key not in value:
            if option.default is REQUIRED:
                problems.append(f"{name} needs a {key}, for example {EXAMPLES[name]}")
            options[key] = None if option.default is REQUIRED else option.default
            continue
        problem = option.check(value[key])
        if problem:
            problems.append(f"{name}.{key}: {problem}")
        options[key] = value[key]
    return options, problems
