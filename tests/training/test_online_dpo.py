"""Online DPO end to end on the tiny model: a run on torch, its metrics, the config's checks, and exact
resume after a SIGKILL. The maths (ranking, loss, gradients) is checked against TRL in
test_online_dpo_oracle.py; online DPO shares GRPO's sampling and rollouts (test_grpo.py)."""

from __future__ import annotations

import json
import math

import pytest

from mudpuppy import load_config, run
from mudpuppy.errors import ConfigError

from .test_grpo import assert_resume_is_exact, grpo_config


def online_dpo_config(tiny_config, out, **section) -> dict:
    cfg = grpo_config(tiny_config, out)
    cfg["method"] = "online_dpo"
    grpo = cfg.pop("grpo")
    cfg["online_dpo"] = {"max_completion_length": grpo["max_completion_length"],
                         "reward_funcs": grpo["reward_funcs"], **section}
    return cfg


def test_an_online_dpo_run_trains_on_ranked_pairs(tiny_config, tmp_path):
    result = run(load_config(online_dpo_config(tiny_config, tmp_path / "run", missing_eos_penalty=0.5)),
                 echo=lambda *_: None)
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward"]) for r in rows)
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)      # policy = reference: -log sigmoid(0)
    assert rows[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert all(r["loss"] != pytest.approx(math.log(2), abs=1e-4) for r in rows[1:])   # and it moved
    samples = [json.loads(line) for line in (result.output_dir / "completions.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 4 and {s["advantage"] for s in samples} == {1.0, -1.0}
    summary = json.loads((result.output_dir / "run_summary.json").read_text())
    assert summary["method"] == "online_dpo"


def test_online_dpo_config_is_checked_up_front(tiny_config, tmp_path):
    cfg = online_dpo_config(tiny_config, tmp_path / "run", num_generations=3)
    with pytest.raises(ConfigError, match="online_dpo.num_generations"):
        load_config(cfg)
    cfg = online_dpo_config(tiny_config, tmp_path / "run", epsilon=0.2)      # no ratio to clip
    with pytest.raises(ConfigError, match="online_dpo.epsilon"):
        load_config(cfg)
    cfg = online_dpo_config(tiny_config, tmp_path / "run")
    cfg["training"]["micro_batch_size"] = 3
    cfg["training"]["gradient_accumulation_steps"] = 2
    with pytest.raises(ConfigError, match="training.micro_batch_size: online_dpo trains on pairs"):
        load_config(cfg)
    cfg = online_dpo_config(tiny_config, tmp_path / "run")
    cfg["adapter"] = {"type": "none"}
    with pytest.raises(ConfigError, match="online_dpo.beta: .*use an adapter"):
        load_config(cfg)


def test_sigkill_then_resume_gives_the_same_rewards_and_losses(tiny_config, tmp_path):
    """As GRPO's: the kill lands inside a generation (one pair a micro-batch, two micro-batches a
    generation), and the pairs, their roles and reference log-probs come back from the checkpoint."""
    def make(out):
        cfg = online_dpo_config(tiny_config, out, steps_per_generation=2)
        cfg["training"]["micro_batch_size"] = 2
        return cfg

    assert_resume_is_exact(tmp_path, make)
