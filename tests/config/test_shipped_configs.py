"""Every shipped config validates, opens with the command that runs it, and points at shipped data."""

from __future__ import annotations

from pathlib import Path

import pytest

from mudpuppy.configure import load_config
from mudpuppy.training.curriculum import is_curriculum, load_curriculum

from ..conftest import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_there_is_a_config_per_sft_variant():
    names = {p.stem for p in CONFIGS}
    assert {"quickstart", "sft-full", "sft-lora", "sft-dora", "sft-qlora-int4", "sft-qlora-mxfp4"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_and_says_how_to_run_it(path: Path):
    # Data files must exist: check_files is on. A curriculum is checked stage by stage.
    cfgs = [s.cfg for s in load_curriculum(path).stages] if is_curriculum(path) else [load_config(path)]
    first = path.read_text().splitlines()[0]
    assert first.startswith("# mudpuppy ") and f"configs/{path.name}" in first
    for cfg in cfgs:
        for spec in cfg.data.datasets + cfg.data.val_datasets:
            assert cfg.resolve_path(spec.path).is_relative_to(REPO / "configs")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_what_a_run_records_of_its_config_loads_back_to_the_same_config(path: Path):
    """A run writes cfg.dump() as its config.yaml, which eval, export, merge and --resume load again: it must
    load, and to the same settings (an mxfp4 run's dump once carried a group size that mxfp4 refuses)."""
    cfgs = [s.cfg for s in load_curriculum(path).stages] if is_curriculum(path) else [load_config(path)]
    for cfg in cfgs:
        again = load_config(cfg.dump(), check_files=False)
        assert again.dump() == cfg.dump()
