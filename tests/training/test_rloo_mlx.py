"""RLOO's objective, written once, on MLX and on torch: same model, adapter and rollouts, within 1e-4;
then short RLOO and online DPO runs through the recipe on MLX (sampling, rewards, the shared loop)."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("mlx.core")

from mudpuppy import load_config
from mudpuppy.config.methods import RlooConfig
from mudpuppy.training.rloo import RlooObjective

from .test_grpo_mlx import assert_steps_agree, rollouts, run_two_steps_on_mlx
from .test_preference_mlx import assert_objectives_agree, backends, run_config, same_adapter  # noqa: F401
from .test_online_dpo import online_dpo_config
from .test_rloo import rloo_config

pytestmark = pytest.mark.mlx
TOL = 1e-4


def test_rloo_objective_and_training_agree_with_torch(backends, tiny_model_dir, tmp_path):
    torch_backend, mlx_backend = backends
    raw = run_config(tiny_model_dir, tmp_path, "dpo")
    raw["adapter"]["dropout"] = 0.0     # a sequence's ratio sums its tokens' dropout noise: it would clip them all
    cfg = load_config(raw)
    th, mh = same_adapter(backends, cfg, tmp_path)
    r = RlooConfig(reward_funcs=["exact_match"], temperature=0.9, epsilon_high=0.28)
    # Only the first token of each micro-batch shifted: its completion clips, the others carry the gradient.
    batches = rollouts(torch_backend, th, r.temperature, every=10**6)
    t_obj, m_obj = RlooObjective(torch_backend, r), RlooObjective(mlx_backend, r)
    t_metrics = assert_objectives_agree(backends, (t_obj, m_obj), (th, mh), batches[0])
    assert 0 < t_metrics["clip_ratio/region_mean"] < 1
    # A small rate: at 1e-3 every sequence's ratio has left the clip range by the third step.
    assert_steps_agree(backends, (th, mh), (t_obj, m_obj), batches, cfg.training, 1e-4)


def test_an_rloo_run_trains_on_mlx_through_the_recipe(tiny_config, tmp_path):
    result = run_two_steps_on_mlx(rloo_config(tiny_config, tmp_path / "run", beta=0.05))
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward"]) and "kl" in r for r in rows)


def test_an_online_dpo_run_trains_on_mlx_through_the_recipe(tiny_config, tmp_path):
    """Online DPO shares the recipe and the preference losses: two steps on MLX, a finite DPO loss that
    starts at log 2 (the adapter starts as the reference)."""
    result = run_two_steps_on_mlx(online_dpo_config(tiny_config, tmp_path / "run"))
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert all(math.isfinite(r["loss"]) and "reward_margin" in r for r in rows)
