"""RLOO and online DPO runs chart their rewards as GRPO's do: the report's curves for each method name
metrics the method really logs, and a real run on the tiny model writes them and links them in its card."""

from __future__ import annotations

import json

import pytest

from mudpuppy import load_config, run
from mudpuppy.monitor.report import METHOD_CURVES

from ..training.test_grpo import RL_DATA, grpo_config
from ..training.test_online_dpo import online_dpo_config
from ..training.test_rloo import rloo_config

MAKERS = {"grpo": grpo_config, "rloo": rloo_config, "online_dpo": online_dpo_config}


@pytest.mark.parametrize("method, charts", [
    ("rloo", ["reward.png"]),
    ("online_dpo", ["reward.png", "margins.png"]),
])
def test_rloo_and_online_dpo_runs_chart_their_logged_rewards(tiny_config, tmp_path, method, charts):
    pytest.importorskip("matplotlib")
    cfg = MAKERS[method](tiny_config, tmp_path / method)
    cfg["data"]["val_datasets"] = [{"path": str(RL_DATA)}]
    cfg["eval"] = {"before_training": False, "after_training": False, "max_samples": 2}
    cfg["training"]["eval_steps"] = 2           # the held-out reward at steps 2 and 4, as GRPO's is logged
    out = run(load_config(cfg), echo=lambda *_: None).output_dir
    logged = set().union(*(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()))
    declared = METHOD_CURVES[method]
    assert [name for name, _title, _keys in declared] == charts
    for name, _title, keys in declared:
        # Every curve the chart draws is one the method logs: a renamed metric would leave it empty.
        assert {k for k, _label in keys} <= logged, (name, logged)
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"![{name[:-4]}]({name})" in (out / "README.md").read_text()


def test_grpo_and_the_new_methods_share_the_reward_chart():
    assert METHOD_CURVES["rloo"][0] == METHOD_CURVES["grpo"][0] == METHOD_CURVES["online_dpo"][0]
    assert METHOD_CURVES["online_dpo"][1] == METHOD_CURVES["preference"][0]
