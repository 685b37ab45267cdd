"""RLOO end to end on the tiny model: a run on torch (and on MLX, whose objective agrees with torch's), its
metrics and completions, the config's checks, and exact resume after a SIGKILL.

The maths (advantages, KL in the reward, loss and gradients) is checked against TRL in
test_rloo_oracle.py; RLOO shares GRPO's sampling and rollouts (test_grpo.py).
"""

from __future__ import annotations

import json
import math

import pytest

from mudpuppy import load_config, run
from mudpuppy.errors import ConfigError

from .test_grpo import assert_resume_is_exact, grpo_config


def rloo_config(tiny_config, out, **rloo) -> dict:
    cfg = grpo_config(tiny_config, out)
    cfg["method"] = "rloo"
    cfg["rloo"] = {**cfg.pop("grpo"), **rloo}
    return cfg


def test_an_rloo_run_logs_rewards_kl_and_completions(tiny_config, tmp_path):
    cfg = rloo_config(tiny_config, tmp_path / "run", beta=0.05, num_iterations=2, normalize_advantages=True,
                      reward_clip_range=[-5.0, 5.0])
    result = run(load_config(cfg), echo=lambda *_: None)
    out = result.output_dir
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in rows)
    made = [r for r in rows if "reward" in r]
    assert [r["step"] for r in made] == [1, 3]        # num_iterations 2: each generation serves two steps
    for key in ("reward", "reward_std", "frac_reward_zero_std", "rewards/length/mean", "kl",
                "completions/mean_length"):
        assert key in made[0], key
    assert made[0]["kl"] == pytest.approx(0.0, abs=1e-6)     # the adapter starts as the reference
    assert made[1]["kl"] != 0.0                              # and has moved by the second generation
    for key in ("entropy", "clip_ratio/region_mean"):
        assert all(key in r for r in rows), key
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 4
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["method"] == "rloo" and summary["first_reward"] == made[0]["reward"]
    assert math.isfinite(summary["final_reward"])


def test_rloo_config_is_checked_up_front(tiny_config, tmp_path):
    cfg = rloo_config(tiny_config, tmp_path / "run", num_generations=3)
    with pytest.raises(ConfigError, match="rloo.num_generations"):
        load_config(cfg)
    cfg = rloo_config(tiny_config, tmp_path / "run")          # beta 0.05 by default, as TRL's
    cfg["adapter"] = {"type": "none"}
    with pytest.raises(ConfigError, match="rloo.beta"):
        load_config(cfg)
    cfg = rloo_config(tiny_config, tmp_path / "run", loss_type="dapo")
    with pytest.raises(ConfigError, match="rloo.loss_type"):  # GRPO's keys are not RLOO's
        load_config(cfg)
    cfg = rloo_config(tiny_config, tmp_path / "run", reward_clip_range=[2.0, 1.0])
    with pytest.raises(ConfigError, match="rloo.reward_clip_range"):
        load_config(cfg)
    cfg = rloo_config(tiny_config, tmp_path / "run")
    cfg["grpo"] = dict(cfg["rloo"])
    with pytest.raises(ConfigError, match="grpo: this section applies to method: grpo"):
        load_config(cfg)


def test_sigkill_then_resume_gives_the_same_rewards_and_losses(tiny_config, tmp_path):
    """As GRPO's: the kill lands inside a generation, and the KL-shaped advantages come back from the
    checkpoint's rollouts."""
    assert_resume_is_exact(tmp_path, lambda out: rloo_config(tiny_config, out, steps_per_generation=2, beta=0.05))
