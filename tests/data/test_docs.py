"""docs/data.md stays true: every format's example records are detected as that format, and
the method table in the docs matches METHOD_FORMATS."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mudpuppy.data.formats import FORMATS, METHOD_FORMATS, detect_format, normalize_records
from mudpuppy.data.readers import RawSource, Record

DOC = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()


def section_records(name: str) -> list[dict]:
    section = DOC.split(f"\n### {name}\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    block = re.search(r"```jsonl\n(.*?)```", section, re.S).group(1)
    return [json.loads(line) for line in block.splitlines() if line.strip()]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_documented_examples_are_valid_records_of_their_format(fmt):
    records = section_records(fmt)
    raw = RawSource("docs", [Record(r, i + 1, i + 1) for i, r in enumerate(records)], "")
    assert detect_format(raw) == fmt
    assert len(normalize_records(raw, fmt, tolerant=False)) == len(records)


def test_documented_method_table_matches_the_code():
    for fmt in FORMATS:
        row = re.search(rf"^\| `{fmt}` \|.*\| (.*) \|$", DOC, re.M)
        assert row, fmt
        documented = {m.split(" ")[0] for m in row.group(1).split(", ")}
        assert documented == {m for m, formats in METHOD_FORMATS.items() if fmt in formats}, fmt
