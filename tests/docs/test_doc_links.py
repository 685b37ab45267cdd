"""Every docs page the code, the configs, the README and the docs themselves point at exists, and every
Python block in docs/quantization.md imports what it names: code once pointed readers at a
docs/quantization.md that did not exist (issue 39)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MENTION = re.compile(r"\bdocs/([\w.-]+\.md)")                   # "See docs/quantization.md."
LINK = re.compile(r"\]\(((?!https?:|#|mailto:)[^)#\s]+)")     # [text](page.md#anchor), relative only


def sources() -> list[Path]:
    return [*sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "configs").glob("*.yaml")), ROOT / "README.md",
            ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md"))]


def pointers(path: Path) -> list[tuple[Path, str]]:
    """(the file it must name, as written) for each docs page `path` points at."""
    text = path.read_text(encoding="utf-8")
    found = [(ROOT / "docs" / name, f"docs/{name}") for name in MENTION.findall(text)]
    if path.suffix == ".md":
        found += [((path.parent / target).resolve(), target) for target in LINK.findall(text)]
    return found


def test_every_docs_page_pointed_at_exists():
    missing = [f"{path.relative_to(ROOT)} -> {shown}" for path in sources() for target, shown in pointers(path)
               if not target.exists()]
    assert not missing, "pointers to pages that do not exist:\n" + "\n".join(missing)


def test_the_checker_sees_a_missing_page(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See docs/nowhere.md and [this](other.md#x), [web](https://x.org/a.md).\n")
    names = [shown for _, shown in pointers(page)]
    assert names == ["docs/nowhere.md", "other.md"]


@pytest.mark.parametrize("page", ["quantization.md"])
def test_python_blocks_import_what_they_name(page):
    for block in re.findall(r"```python\n(.*?)```", (ROOT / "docs" / page).read_text(encoding="utf-8"), re.S):
        exec(compile(block, page, "exec"), {})
