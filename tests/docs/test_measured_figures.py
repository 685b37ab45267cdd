"""Every table of measured figures in docs/memory.md says, just before it, which machine measured it and on
what date (issue 39: the page said "this machine" for figures that three kinds of machine had measured)."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "memory.md"
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
MACHINE = re.compile(r"AVX2 machine|AMX machine|AVX512-BF16 machine|H100|H200|MI\d{3}")
FIGURE = re.compile(r"\d\.\d")


def figure_tables(text: str) -> list[tuple[int, str]]:
    """(first line number, the 15 lines before it) of each table holding a measured figure."""
    lines, found, start = text.splitlines(), [], None
    for i, line in enumerate(lines + [""]):
        if line.startswith("|") and start is None:
            start = i
        elif not line.startswith("|") and start is not None:
            if any(FIGURE.search(row) for row in lines[start + 2:i]):
                found.append((start + 1, "\n".join(lines[max(0, start - 15):start])))
            start = None
    return found


def test_each_table_of_figures_names_its_machine_and_date():
    tables = figure_tables(DOC.read_text(encoding="utf-8"))
    assert len(tables) >= 5
    unnamed = [line for line, before in tables if not (DATE.search(before) and MACHINE.search(before))]
    assert not unnamed, f"docs/memory.md: the tables at lines {unnamed} do not say which machine, when"


def test_no_figure_is_left_to_this_machine():
    assert not re.search(r"\b[Tt]his machine\b", DOC.read_text(encoding="utf-8"))


def test_the_checker_sees_a_table_without_its_machine():
    text = "On 2026-11-23.\n\n| run | peak |\n| --- | --- |\n| LoRA | 2.72 GB |\n"
    (table,) = figure_tables(text)
    assert DATE.search(table[1]) and not MACHINE.search(table[1])
