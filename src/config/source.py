"""Reading a run's config: the YAML file (or a dict) and the ``key.sub=value`` overrides given with it
(``--set`` on the command line), before any validation. A file that cannot be read ends here in one
`ConfigError`; an override that cannot be applied becomes an `Issue` reported with the others."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from .issues import Issue


def read_source(source: str | os.PathLike | dict, overrides) -> tuple[dict, str, str | None, list[Issue]]:
    """(raw mapping with the overrides applied, where it came from, its directory, override problems)."""
    if isinstance(source, dict):
        raw, origin, source_dir = copy.deepcopy(source), "<dict>", None
    else:
        origin = str(source)
        raw = _read_yaml(Path(source))
        source_dir = str(Path(source).resolve().parent)
    issues: list[Issue] = []
    for item in overrides:
        try:
            apply_override(raw, item)
        except ValueError as exc:
            issues.append(Issue(f"--set {item}", str(exc)))
    return raw, origin, source_dir, issues


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(str(path), ["config file not found"])
    try:
        with path.open("r", encoding="utf-8") as fh:
            raw = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(str(path), [f"{where}not valid YAML ({getattr(exc, 'problem', exc)})"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), [f"not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None
    if raw is None:
        raise ConfigError(str(path), ["the file is empty"])
    if not isinstance(raw, dict):
        raise ConfigError(str(path), [f"expected a mapping of sections at the top, found {type(raw).__name__}"])
    return raw


def apply_override(raw: dict, item: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML.

    Numeric segments index lists (``data.datasets.0.path=x.jsonl``).
    """
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ValueError("expected KEY=VALUE, e.g. training.max_steps=5")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    parts = key.strip().split(".")
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        node = _step_into(node, part, ".".join(parts[: depth + 1]))
    last = parts[-1]
    if isinstance(node, list):
        idx = _index(node, last, key)
        node[idx] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ValueError(f"'{'.'.join(parts[:-1])}' is a value, not a section")


def _step_into(node: Any, part: str, where: str) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, where)]
    if not isinstance(node, dict):
        raise ValueError(f"'{where}' is inside a value, not a section")
    if node.get(part) is None:
        node[part] = {}
    return node[part]


def _index(node: list, part: str, where: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ValueError(f"'{where}': list index {part!r} out of range (list has {len(node)} items)")
    return int(part)
