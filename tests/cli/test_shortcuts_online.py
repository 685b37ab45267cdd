"""`mudpuppy train --method rloo | online_dpo` and `mudpuppy init` for them: the same config a YAML file
would hold (their own section, reward functions from --reward, whole groups per micro-batch)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mudpuppy.cli import main
from mudpuppy.configure import load_config
from mudpuppy.errors import MudpuppyError
from mudpuppy.shortcuts import init_config_text, train_config, write_init_config

from ..conftest import QUICKSTART_DATA

RL_DATA = str(QUICKSTART_DATA / "sample_rl.jsonl")
SFT_DATA = str(QUICKSTART_DATA / "smart_home_train.jsonl")


@pytest.mark.parametrize("method, section", [("rloo", "rloo"), ("online_dpo", "online_dpo"),
                                             ("online-dpo", "online_dpo"), ("grpo", "grpo")])
def test_online_methods_get_their_section_and_rewards(method, section):
    raw = train_config("m", RL_DATA, method, rewards=("exact_match", "contains"))
    assert raw["method"] == section and raw["adapter"]["type"] == "lora"
    assert raw[section] == {"reward_funcs": ["exact_match", "contains"]}
    assert not {"grpo", "rloo", "online_dpo"} - {section} & set(raw)
    cfg = load_config(raw)                   # whole groups (rloo: 2) and whole pairs per micro-batch of 8
    assert cfg.method == section and cfg.training.micro_batch_size == 8
    assert train_config("m", RL_DATA, method)[section] == {"reward_funcs": ["exact_match"]}


def test_reward_is_refused_for_offline_methods():
    with pytest.raises(MudpuppyError, match="--reward applies to --method grpo \\(rl\\), rloo and online_dpo"):
        train_config("m", SFT_DATA, "dpo", rewards=("exact_match",))


@pytest.mark.parametrize("method", ["rloo", "online_dpo"])
def test_init_writes_a_commented_online_config_that_validates(tmp_path, method):
    target = tmp_path / f"{method}.yaml"
    text = init_config_text(target, "smollm2-135m-instruct", RL_DATA, method, "cpu", f"outputs/{method}")
    assert f"method: {method}" in text and f"\n{method}:\n  reward_funcs: [exact_match]" in text
    assert "learning_rate: 5.0e-6" in text
    write_init_config(target, text)          # validated by load_config before it is written
    cfg = load_config(target)
    assert cfg.method == method
    section = getattr(cfg, method)
    assert section.max_completion_length == 64
    if method == "rloo":
        assert section.num_generations == 4 and section.beta == 0.05
    else:
        assert section.beta == 0.1


def test_train_runs_rloo_from_the_command_line(tiny_model_dir, tmp_path):
    out = tmp_path / "rloo"
    res = CliRunner().invoke(main, ["train", str(tiny_model_dir), RL_DATA, "--method", "rloo", "--output", str(out),
                                    "--backend", "cpu", "--max-steps", "1", "--batch-size", "4",
                                    "--sequence-len", "64", "--lora-r", "4", "--precision", "fp32"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["method"] == "rloo"
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward" in row and "rewards/exact_match/mean" in row
