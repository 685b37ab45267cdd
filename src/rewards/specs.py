"""`grpo.reward_funcs` and `grpo.reward_weights` -> a list of `RewardSpec`. Pure Python, no file access.

Config validation calls `parse_reward_specs`; it raises one ValueError listing every problem,
each named by its entry (`reward_funcs[2]: ...`). Whether files exist and import is the loader's
business (rewards/loading.py), at run time.

Each entry of `reward_funcs` is one of:

    exact_match                            a built-in by name: exact_match, contains, format, regex, length
                                           (format and regex need a pattern, length a target: use the mapping form)
    rewards/format.py:has_answer_tag       a function in a Python file: relative to the config's folder, else the cwd
    mypkg.rewards:length_penalty           a function in an importable module
    {exact_match: {column: solution}}      a built-in with options, as a mapping ...
    {exact_match: solution}                ... or as the shorthand scalar (see rewards/options.py)
    {reward_model: outputs/rm, batch_size: 16}   a scalar-head model trained with method: rm
    {function: "rewards/f.py:score"}       a user function, in mapping form

Any mapping may add `name:` to set the display name. Display names label the metrics
(`rewards/<name>/mean`): a built-in's name, a user function's name, `reward_model`; repeats get
`_2`, `_3`, ... in order. `reward_weights` is null (every weight 1.0) or one finite number per entry.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from .options import BUILTIN_NAMES, BUILTIN_OPTIONS, builtin_options

_IDENT = r"[A-Za-z_]\w*"
_FILE = re.compile(rf"(?P<target>.+\.py):(?P<function>{_IDENT})")
_MODULE = re.compile(rf"(?P<target>{_IDENT}(?:\.{_IDENT})*):(?P<function>{_IDENT})")
_DISPLAY_NAME = re.compile(r"[\w.\-]+")
FORMS = ("a built-in (" + ", ".join(BUILTIN_NAMES) + "), a function in a file ('path/to/file.py:function'), "
         "a function in a module ('package.module:function'), or {reward_model: PATH}")


@dataclass(frozen=True)
class RewardSpec:
    """One reward function as the config names it."""

    kind: str                      # "builtin" | "file" | "module" | "reward_model"
    name: str                      # display name: metrics are rewards/<name>/mean
    target: str                    # built-in name, file path as written, module path, or reward model path
    function: str | None = None    # the function's name, for file and module specs
    options: tuple = ()            # sorted (key, value) pairs: a built-in's or a reward model's options
    weight: float = 1.0

    @property
    def source(self) -> str:
        """How the config wrote it, for messages."""
        if self.kind in ("file", "module"):
            return f"{self.target}:{self.function}"
        return f"{{reward_model: {self.target}}}" if self.kind == "reward_model" else self.target

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)


def parse_reward_specs(items: list, weights: list[float] | None) -> list[RewardSpec]:
    """Parse and check every entry and the weights; raise one ValueError joining all problems with '; '."""
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"reward_funcs: expected a list of one or more reward functions, each {FORMS}")
    specs, problems = [], []
    for i, item in enumerate(items):
        spec, found = _parse_item(item)
        specs.append(spec)
        problems += [f"reward_funcs[{i}]: {p}" for p in found]
    weights, found = _weights(weights, len(items))
    problems += found
    if problems:
        raise ValueError("; ".join(problems))
    names = unique_names([s.name for s in specs])
    return [replace(s, name=n, weight=w) for s, n, w in zip(specs, names, weights)]


def _parse_item(item: Any) -> tuple[RewardSpec | None, list[str]]:
    if isinstance(item, str):
        return _parse_string(item.strip())
    if isinstance(item, dict):
        return _parse_mapping(item)
    return None, [f"expected a name or a mapping, got {type(item).__name__} {item!r}"]


def _parse_string(text: str) -> tuple[RewardSpec | None, list[str]]:
    if text in BUILTIN_OPTIONS:
        return _builtin(text, None)
    spec = _user_function(text)
    return (spec, []) if spec else (None, [_unknown(text)])


def _builtin(name: str, value: Any) -> tuple[RewardSpec, list[str]]:
    options, problems = builtin_options(name, value)
    return RewardSpec("builtin", name, name, options=tuple(sorted(options.items()))), problems


def function_spec(text: str) -> RewardSpec | None:
    """'path/file.py:func' or 'package.module:func' as a spec (GRPO's tools and environments are
    named the same way as reward functions); None if `text` is neither."""
    return _user_function(text.strip())


def _user_function(text: str) -> RewardSpec | None:
    """'path/file.py:func' or 'package.module:func' as a spec; None if `text` is neither."""
    for kind, form in (("file", _FILE), ("module", _MODULE)):
        m = form.fullmatch(text)
        if m:
            return RewardSpec(kind, m["function"], m["target"], function=m["function"])
    return None


def _unknown(text: str) -> str:
    if text.endswith(".py"):
        return f"'{text}' names a file but no function in it; write it as '{text}:my_reward'"
    if ".py:" in text or ":" in text:
        return f"'{text}': after the ':' comes the function's name, a Python identifier ('rewards.py:my_reward')"
    close = difflib.get_close_matches(text, BUILTIN_NAMES, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown reward function '{text}'{hint}; use {FORMS}"


def _parse_mapping(item: dict) -> tuple[RewardSpec | None, list[str]]:
    problems = _check_name(item["name"]) if "name" in item else []
    keys = [k for k in item if k != "name"]
    if "reward_model" in keys:
        spec, found = _reward_model(item)
    elif "function" in keys:
        spec, found = _function(item)
    elif len(keys) == 1 and keys[0] in BUILTIN_OPTIONS:
        spec, found = _builtin(keys[0], item[keys[0]])
    elif not keys:
        spec, found = None, [f"an empty mapping; use {FORMS}"]
    else:
        spec, found = None, [_bad_keys(keys)]
    problems += found
    if spec is not None and "name" in item and not problems:
        spec = replace(spec, name=item["name"])
    return (None if problems else spec), problems


def _bad_keys(keys: list) -> str:
    unknown = [str(k) for k in keys if k not in BUILTIN_OPTIONS]
    if not unknown:
        return f"one built-in per entry, got {', '.join(map(str, keys))}; give each its own entry"
    close = difflib.get_close_matches(unknown[0], BUILTIN_NAMES, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown key {', '.join(repr(k) for k in unknown)}{hint}; a mapping names {FORMS}"


def _check_name(name: Any) -> list[str]:
    if isinstance(name, str) and _DISPLAY_NAME.fullmatch(name):
        return []
    return [f"name: expected letters, digits, '_', '.' or '-' (it names the metric rewards/<name>/mean), got {name!r}"]


def _extra_keys(item: dict, allowed: tuple[str, ...]) -> list[str]:
    return [f"unknown key '{k}' beside {allowed[0]} (allowed: {', '.join(allowed)})" for k in item if k not in allowed]


def _reward_model(item: dict) -> tuple[RewardSpec | None, list[str]]:
    problems = _extra_keys(item, ("reward_model", "batch_size", "name"))
    path, batch = item["reward_model"], item.get("batch_size", 16)
    if not isinstance(path, str) or not path.strip():
        problems.append(f"reward_model: expected the path of a model trained with method: rm, got {path!r}")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        problems.append(f"batch_size: expected a whole number above 0, got {batch!r}")
    spec = RewardSpec("reward_model", "reward_model", str(path), options=(("batch_size", batch),))
    return (None if problems else spec), problems


def _function(item: dict) -> tuple[RewardSpec | None, list[str]]:
    problems = _extra_keys(item, ("function", "name"))
    text = item["function"]
    spec = _user_function(text.strip()) if isinstance(text, str) else None
    if spec is None:
        problems.append(f"function: expected 'path/to/file.py:function' or 'package.module:function', got {text!r}")
    return (None if problems else spec), problems


def _weights(weights: Any, count: int) -> tuple[list[float], list[str]]:
    if weights is None:
        return [1.0] * count, []
    if not isinstance(weights, (list, tuple)):
        return [], [f"reward_weights: expected a list of numbers (or null for all 1.0), got {weights!r}"]
    if len(weights) != count:
        plural = "s" if len(weights) != 1 else ""
        problem = (f"reward_weights: {len(weights)} weight{plural} for {count} reward_funcs; "
                   "give one per function, in the same order (or null for all 1.0)")
        return [], [problem]
    problems = [f"reward_weights[{i}]: expected a finite number, got {w!r}" for i, w in enumerate(weights)
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)]
    return ([] if problems else [float(w) for w in weights]), problems


def unique_names(names: list[str]) -> list[str]:
    """Repeats get `_2`, `_3`, ... in order, skipping any suffixed name already taken."""
    taken, out = set(names), []
    for name in names:
        if name in out:
            k = 2
            while f"{name}_{k}" in taken:
                k += 1
            name = f"{name}_{k}"
            taken.add(name)
        out.append(name)
    return out
