"""docs/config.md against the schema it documents (src/config/): every key has a row (or, for a top-level
scalar, a section of its own), the row states the key's default, and every choice a key accepts is named in
it. A key added to the schema without its line in the reference fails here, as `qlora`, `quant_backend`,
`quant_group_size` and `grpo.use_bias_correction_kl` once went missing (issue 39)."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from mudpuppy.config import RunConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e-?\d+)?(?:\s*(KiB|MiB|GiB))?")
UNITS = {None: 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


# --------------------------------------------------------------------------- the schema
def _model_in(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for a in typing.get_args(annotation) if (m := _model_in(a))), None)


def _choices(annotation) -> list:
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    return [c for a in typing.get_args(annotation) for c in _choices(a)]


def _default(field):
    if field.default is not PydanticUndefined:
        return field.default
    return field.default_factory() if field.default_factory else "required"


def schema_keys(model=RunConfig, prefix="") -> dict[str, tuple[object, list, bool]]:
    """dotted key -> (default, choices, whether it is a section of keys)."""
    keys = {}
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        sub, path = _model_in(field.annotation), prefix + name
        keys[path] = (_default(field), _choices(field.annotation), sub is not None)
        if sub is not None and path != "data.val_datasets":      # one spec for both lists, documented once
            keys.update(schema_keys(sub, path + "."))
    return keys


SCHEMA = schema_keys()
SECTIONS = {k for k, (_, _, section) in SCHEMA.items() if section}


# --------------------------------------------------------------------------- the reference
def read_reference(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """(rows: dotted key -> its table row, headings: key -> the prose of the section its heading opens).
    A row's key is its section's (`## \`data\``), or the entry's under "Each entry of `datasets`", unless
    written whole (`logging.log_every`)."""
    rows, headings, prefix, opened, intro = {}, {}, "", [], ""
    for line in text.splitlines():
        if line.startswith("#"):
            opened = re.findall(r"`([^`]+)`", line)          # "## `output_dir` and `logging`" opens both
            prefix = opened[0] if opened and opened[0] in SECTIONS else ""
            headings.update({name: "" for name in opened})
            intro = ""
            continue
        for name in opened:
            headings[name] += line + "\n"
        if line.startswith("| `"):
            each = re.match(r"Each entry of `([^`]+)`", intro)
            table = f"{prefix}.{each[1]}" if each else prefix
            for name in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
                rows[name if "." in name or not table else f"{table}.{name}"] = line
        elif line.strip() and not line.startswith("|"):
            intro = line
    return rows, headings


ROWS, HEADINGS = read_reference(DOC.read_text(encoding="utf-8"))


def states_default(text: str, default) -> bool:
    """Whether `text` (a row, or a section's prose) states `default`."""
    if default is None or default == [] or default == "required" and "required" in text:
        return default is not None or bool(text.strip())
    if isinstance(default, bool):
        return f"`{str(default).lower()}`" in text or f" {str(default).lower()} " in text
    if isinstance(default, (int, float)):
        return any(float(m[0].split()[0]) * UNITS[m[1] or None] == default for m in NUMBER.finditer(text))
    if isinstance(default, str):
        return f"`{default}`" in text or f"| {default} |" in text or f"{default} (default)" in text
    if isinstance(default, list):
        return all(str(d) in text for d in default)
    return True                                  # a section: its keys are checked one by one


def where(key: str) -> str | None:
    if key in ROWS:
        return ROWS[key]
    if key in HEADINGS:
        return HEADINGS[key]
    return None


@pytest.mark.parametrize("key", sorted(SCHEMA))
def test_every_key_is_documented(key):
    assert where(key) is not None, f"docs/config.md has no row (or section) for `{key}`"


@pytest.mark.parametrize("key", sorted(k for k in SCHEMA if not SCHEMA[k][2]))
def test_every_default_is_stated(key):
    text = where(key)
    if text is None:
        pytest.skip("undocumented: test_every_key_is_documented names it")
    default = SCHEMA[key][0]
    if key in ROWS:
        text = ROWS[key].split(" | ")[1]       # the row's default cell, not its explanation
    elif isinstance(default, str) and default != "required":
        text = text if f"`{default}` (default" in text else ""     # prose says which choice is the default
    assert states_default(text, default), f"`{key}`: docs/config.md does not state its default {default!r}"


@pytest.mark.parametrize("key", sorted(k for k in SCHEMA if SCHEMA[k][1]))
def test_every_choice_is_named(key):
    text = where(key)
    if text is None:
        pytest.skip("undocumented: test_every_key_is_documented names it")
    missing = [c for c in SCHEMA[key][1] if str(c) not in text]
    assert not missing, f"`{key}`: docs/config.md does not name the choices {missing}"


def test_the_reference_documents_no_key_the_schema_lacks():
    stale = [k for k in ROWS if k not in SCHEMA]
    assert not stale, f"docs/config.md documents keys the schema does not have: {stale}"


def test_the_checker_sees_a_missing_key_and_a_wrong_default():
    """The parser above on a tiny reference: it must miss what is missing and refuse a wrong default."""
    rows, _ = read_reference("## `adapter`\n\n| key | default | meaning |\n| --- | --- | --- |\n"
                             "| `r` | 4 | rank |\n\nEach entry of `datasets`:\n\n| `path` | required | x |\n")
    assert "adapter.r" in rows and "adapter.alpha" not in rows and "adapter.datasets.path" in rows
    assert not states_default(rows["adapter.r"], 8) and states_default(rows["adapter.r"], 4)
    assert states_default("| `x` | 4 MiB | y |", 4 * 2**20) and not states_default("| `x` | `true` |", False)
