"""Reading a run's config: the YAML file (or a dict) and the ``key.sub=value`` overrides given with it
(``--set`` on the command line), before any validation. A file that cannot be read ends here in one
`ConfigError`; an override that cannot be applied becomes an `Issue` reported with the others.

YAML is read through `BoundedLoader`: PyYAML's safe loader builds an alias once and shares it, but
everything after it (validation, error messages, a dump) walks the value once per reference, so a 1 KB
file of nested aliases ("billion laughs") stands for hundreds of millions of values. The loader counts
each value as often as aliases repeat it, before anything is built, and refuses past `MAX_YAML_VALUES`.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from .issues import Issue, shorten

# Every value of a config counted as often as aliases repeat it. The largest shipped config holds 125
# (configs/grpo-tools.yaml); 1,600 times that leaves room for long lists and still refuses an alias bomb
# (9 anchors of 9 stand for 387 million values) before anything is built.
MAX_YAML_VALUES = 200_000


class ExpansionLimit(yaml.YAMLError):
    """Aliases that expand past the budget, or refer to themselves."""

    def __init__(self, problem: str, mark):
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class BoundedLoader(yaml.SafeLoader):
    """`yaml.safe_load` that refuses a document whose aliases expand past `MAX_YAML_VALUES` values
    (or loop), checked on the composed node graph, before any Python value is constructed."""

    max_values = MAX_YAML_VALUES

    def compose_document(self):
        node = super().compose_document()
        if node is not None:
            check_expansion(node, self.max_values)
        return node


def bounded_yaml_load(stream):
    """`yaml.safe_load` under the alias budget: for every YAML file a user hands mudpuppy."""
    return yaml.load(stream, Loader=BoundedLoader)  # noqa: S506 - a SafeLoader subclass


def check_expansion(root: yaml.Node, limit: int) -> None:
    """Raise ExpansionLimit when `root` stands for more than `limit` values with every alias expanded.

    Each node's expanded size is computed once (a shared node is not walked again), depth first without
    recursion, so the check costs what the file's own node graph does, whatever it expands to."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()          # entered, children not finished: the current path
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            open_nodes.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in _children(node))
            if sizes[key] > limit:
                raise ExpansionLimit(f"the aliases here expand to more than {limit:,} values, far more than a "
                                     "config holds; write the values out or repeat a smaller block",
                                     node.start_mark)
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise ExpansionLimit("an alias here refers to the block that contains it (a loop)", node.start_mark)
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def read_source(source: str | os.PathLike | dict, overrides) -> tuple[dict, str, str | None, list[Issue]]:
    """(raw mapping with the overrides applied, where it came from, its directory, override problems)."""
    if isinstance(source, dict):
        raw, origin, source_dir = copy.deepcopy(source), "<dict>", None
    else:
        origin = str(source)
        raw = _read_yaml(Path(source))
        source_dir = _recorded_source_dir(raw) or str(Path(source).resolve().parent)
    issues: list[Issue] = []
    for item in overrides:
        try:
            apply_override(raw, item)
        except ValueError as exc:
            issues.append(Issue(f"--set {item}", str(exc)))
    return raw, origin, source_dir, issues


def _recorded_source_dir(raw) -> str | None:
    """A run's config.yaml records the folder of the config the run started from (`source_dir`, written
    by output_dir.claim.write_config): its relative data, template and function paths resolve there, as
    they did for the run, not against the run directory. Taken while that folder exists (a run copied to
    another machine falls back to its own folder); the key is the loader's, never a setting."""
    if not isinstance(raw, dict):
        return None
    recorded = raw.pop("source_dir", None)
    if isinstance(recorded, str) and os.path.isabs(recorded) and Path(recorded).is_dir():
        return recorded
    return None


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(str(path), ["config file not found"])
    try:
        with path.open("r", encoding="utf-8") as fh:
            raw = bounded_yaml_load(fh)
    except ExpansionLimit as exc:
        mark = exc.problem_mark
        raise ConfigError(str(path), [f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = shorten(str(getattr(exc, "problem", None) or exc))
        raise ConfigError(str(path), [f"{where}not valid YAML ({problem})"]) from None
    except RecursionError:
        raise ConfigError(str(path), ["nested too deeply to be a config (lists or mappings inside each other "
                                      "hundreds of levels deep)"]) from None
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
        value = bounded_yaml_load(text) if text.strip() else ""
    except (yaml.YAMLError, RecursionError):
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
