"""docs/cli.md and docs/serve.md name every flag of `chat` and `serve`."""

from __future__ import annotations

import pytest

from mudpuppy.cli import main

from ..conftest import REPO


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_every_flag_is_documented(command):
    cli = (REPO / "docs" / "cli.md").read_text()
    section = cli.split(f"## `mudpuppy {command}`", 1)[1].split("\n## ", 1)[0]
    guide = (REPO / "docs" / "serve.md").read_text()
    flags = [opt for p in main.commands[command].params for opt in p.opts if opt.startswith("--")]
    assert flags
    for flag in flags:
        if flag in ("--debug", "--help"):
            continue
        assert flag in section, f"docs/cli.md, mudpuppy {command}: {flag} is not mentioned"
        assert flag in guide, f"docs/serve.md: {flag} is not mentioned"
