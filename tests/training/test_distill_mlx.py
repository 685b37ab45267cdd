"""Distillation's objective, written once, on MLX and on torch: same student adapter, same teacher, same
batch, within the parity tolerance (value and a few optimizer steps); then a short run through the recipe
on MLX with on- and off-policy micro-batches."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("mlx.core")

from mudpuppy import load_config, run
from mudpuppy.training.distill import DistillObjective

from ..conftest import build_tiny_model, tiny_run_config
from .test_distill_oracle import ROWS, batch_of, distill_raw
from .test_grpo_mlx import assert_steps_agree
from .test_preference_mlx import TOL, backends, same_adapter  # noqa: F401

pytestmark = pytest.mark.mlx


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-teacher"), seed=7, hidden_size=48)


def quiet(*_):
    pass


@pytest.mark.parametrize("loss,top_k", [("jsd", 0), ("forward_kl", 0), ("reverse_kl", 0), ("jsd", 5)])
def test_the_objective_and_its_training_agree_with_torch(backends, tiny_model_dir, teacher_dir, tmp_path, loss, top_k):
    torch_backend, mlx_backend = backends
    raw = distill_raw(tiny_model_dir, teacher_dir, tmp_path, loss=loss, top_k=top_k, beta=0.3, temperature=0.8)
    raw["adapter"]["dropout"] = 0.0
    raw["training"].update({"lr_scheduler": "constant"})
    cfg = load_config(raw)
    th, mh = same_adapter(backends, cfg, tmp_path)
    teacher_cfg = load_config(tiny_run_config(teacher_dir, tmp_path / "t")).model
    t_obj = DistillObjective(torch_backend, torch_backend.load_model(teacher_cfg, "fp32"), cfg.distill)
    m_obj = DistillObjective(mlx_backend, mlx_backend.load_model(teacher_cfg, "fp32"), cfg.distill)
    batches = [batch_of(ROWS[:2]), batch_of(ROWS[2:])]
    t_loss, _ = t_obj(th, batches[0], grad=False)
    m_loss, _ = m_obj(mh, batches[0], grad=False)
    assert float(t_loss) > 0
    assert abs(float(t_loss) - float(np.array(m_loss))) < TOL
    assert_steps_agree(backends, (th, mh), (t_obj, m_obj), batches, cfg.training, 1e-2)


def test_a_distill_run_trains_on_mlx_through_the_recipe(tiny_model_dir, teacher_dir, tmp_path):
    raw = distill_raw(tiny_model_dir, teacher_dir, tmp_path, lmbda=0.5, max_completion_length=6)
    raw["backend"] = "mlx"
    raw["training"].update({"max_steps": 3, "gradient_accumulation_steps": 2})
    raw["eval"] = {"before_training": False, "after_training": False}
    result = run(load_config(raw), echo=quiet)
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) and "on_policy" in r for r in rows)
