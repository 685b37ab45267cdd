"""configs/grpo.yaml on the real SmolLM2-135M-Instruct: GRPO raises the reward it is trained on and the
held-out greedy reward. About 18 minutes on a 2-core CPU (`make test-slow`)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mudpuppy.cli import main

from ..conftest import REPO

pytestmark = pytest.mark.slow


def test_grpo_config_raises_the_reward(tmp_path):
    out = tmp_path / "grpo"
    res = CliRunner().invoke(main, ["run", "-c", str(REPO / "configs" / "grpo.yaml"),
                                    "--set", f"output_dir={out}", "--set", "logging.progress_bar=false"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows if "reward" in r and "loss" in r]
    assert len(rewards) == 60
    # Sampled rewards are noisy step to step (two prompts a step): compare tenths of the run.
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.15, (first, last)
    summary = json.loads((out / "run_summary.json").read_text())
    before, after = summary["eval_before"]["eval_reward"], summary["eval_after"]["eval_reward"]
    assert after > before + 0.25, (before, after)
    assert (out / "completions.jsonl").is_file()
