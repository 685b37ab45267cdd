"""pyproject.toml lists its packages explicitly (`packages = [...]`, mapped from src/): a package folder
missing from the list works in an editable install and is absent from a wheel, so a user's `pip install`
would fail at import. Every folder of src/ with an __init__.py must be listed, and nothing else."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_in_the_wheel():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    src = REPO / "src"
    found = {".".join(("mudpuppy", *init.parent.relative_to(src).parts)) for init in src.rglob("__init__.py")}
    assert listed == found, f"missing from pyproject: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"
