"""`mudpuppy parity` on method: distill: the off-policy mode (lmbda pinned to 0, said so) agrees on cpu and
mlx within the fp32 tolerances; a quantized teacher is refused by name."""

from __future__ import annotations

import json

import pytest

from mudpuppy.training.parity import TOLERANCES

from ..cli.test_parity import invoke, step_rows, write_config
from ..conftest import build_tiny_model
from .test_distill_oracle import distill_raw


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-teacher"), seed=7, hidden_size=48)


@pytest.mark.mlx
@pytest.mark.parametrize("distill", [{"loss": "jsd", "lmbda": 0.5}, {"loss": "reverse_kl", "top_k": 8, "lmbda": 0}])
def test_distills_off_policy_mode_agrees_on_cpu_and_mlx(tiny_model_dir, teacher_dir, tmp_path, distill):
    pytest.importorskip("mlx.core")
    raw = distill_raw(tiny_model_dir, teacher_dir, tmp_path, **distill)
    config = write_config(raw, tmp_path, learning_rate=1e-2, gradient_accumulation_steps=2)
    res = invoke(config, "--backends", "cpu,mlx", "--steps", "3", "--json", str(tmp_path / "parity.json"))
    assert res.exit_code == 0, res.output
    assert ("pinned to 0: parity compares distillation's off-policy mode" in res.output) == (distill["lmbda"] > 0)
    assert [r[0] for r in step_rows(res.output)] == ["1", "2", "3"]
    data = json.loads((tmp_path / "parity.json").read_text())
    assert data["ok"] and data["method"] == "distill" and data["max_update"] > 0
    assert all(r["loss"][0] > 0 and r["loss_diff"] <= TOLERANCES["fp32"].loss * max(1, r["loss"][0])
               for r in data["rows"])


def test_a_quantized_teacher_is_refused_by_name(tiny_model_dir, teacher_dir, tmp_path):
    raw = distill_raw(tiny_model_dir, teacher_dir, tmp_path, teacher_quantize=True)
    res = invoke(write_config(raw, tmp_path), "--backends", "cpu,mlx", "--steps", "1")
    assert res.exit_code != 0
    assert "distill.teacher_quantize" in res.output and "own 4-bit format" in res.output
