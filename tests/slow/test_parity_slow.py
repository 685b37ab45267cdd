"""`mudpuppy parity` on the real quickstart (SmolLM2-135M-Instruct): torch-CPU and MLX run the same run.
Minutes on a CPU: MLX's Linux build computes on the CPU without BLAS."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mudpuppy.cli import main

from ..conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.mlx]


def test_quickstart_runs_the_same_on_cpu_and_mlx(tmp_path):
    pytest.importorskip("mlx.core")
    out = tmp_path / "parity.json"
    res = CliRunner().invoke(main, ["parity", str(REPO / "configs" / "quickstart.yaml"), "--backends", "cpu,mlx",
                                    "--steps", "3", "--json", str(out),
                                    "--set", f"output_dir={tmp_path / 'never-written'}"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["ok"] and len(data["rows"]) == 3
    assert all(r["tokens"][0] == r["tokens"][1] for r in data["rows"])
    assert not (tmp_path / "never-written").exists()
