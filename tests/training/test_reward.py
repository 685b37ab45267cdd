"""Reward and process reward models on the tiny model: training, what is saved, plain-transformers reloads, `score`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from mudpuppy import create_backend, load_config, run
from mudpuppy.cli import main
from mudpuppy.data import prepare_data
from mudpuppy.data.pairs import collate_items, pair_items
from mudpuppy.errors import DataError

from ..conftest import QUICKSTART_DATA


def reward_config(tiny_model_dir, tmp_path, method="rm", data="smart_home_pref", adapter="lora", **reward) -> dict:
    return {
        "model": {"base_model": str(tiny_model_dir)},
        "backend": "cpu",
        "method": method,
        "reward": reward,
        "adapter": {"type": adapter, "r": 4, "alpha": 8} if adapter != "none" else {"type": "none"},
        "data": {"datasets": [{"path": str(QUICKSTART_DATA / f"{data}_train.jsonl"), "num_samples": 16}],
                 "val_datasets": [{"path": str(QUICKSTART_DATA / f"{data}_val.jsonl"), "num_samples": 6}],
                 "sequence_len": 128, "cache": False},
        "training": {"max_steps": 3, "micro_batch_size": 4, "learning_rate": 1e-2, "precision": "fp32", "seed": 2},
        "eval": {"batch_size": 8},
        "output_dir": str(tmp_path / f"run-{method}"),
        "logging": {"progress_bar": False},
    }


def val_pairs(cfg, tokenizer):
    cfg = load_config({**cfg, "data": {**cfg["data"], "datasets": cfg["data"]["val_datasets"]}})
    return collate_items(pair_items(prepare_data(cfg, tokenizer).train), tokenizer.pad_token_id)


def test_reward_model_reloads_with_plain_transformers_and_peft(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    cfg = reward_config(tiny_model_dir, tmp_path)
    backend = create_backend("cpu")
    result = run(load_config(cfg), backend, echo=lambda *_: None)
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(k in rows[0] for k in ("loss", "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy"))
    assert result.after.accuracy_name == "reward_accuracy"

    batch = val_pairs(cfg, result.model.tokenizer)
    ours = backend.ops.to_numpy(backend.sequence_scores(result.model, batch.batch, grad=False))
    inputs = {"input_ids": torch.as_tensor(batch.batch.input_ids),
              "attention_mask": torch.as_tensor(batch.batch.attention_mask)}
    with torch.no_grad():
        whole = AutoModelForSequenceClassification.from_pretrained(str(result.output_dir)).eval()
        np.testing.assert_allclose(whole(**inputs).logits[:, 0].numpy(), ours, atol=1e-5, rtol=0)
        base = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1)
        peft = PeftModel.from_pretrained(base, str(result.output_dir / "adapter")).eval()
        np.testing.assert_allclose(peft(**inputs).logits[:, 0].numpy(), ours, atol=1e-5, rtol=0)
    assert np.abs(ours).max() > 0      # a trained head, not a zero one


def test_scores_on_reward_data_train_with_mean_squared_error(tiny_model_dir, tmp_path):
    cfg = reward_config(tiny_model_dir, tmp_path, data="smart_home_reward", adapter="none")
    lines = []
    result = run(load_config(cfg), create_backend("cpu"), echo=lines.append)
    assert any(line.startswith("reward model (mse)") for line in lines)
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert "mse" in rows[0] and result.after.accuracy is None
    assert (result.output_dir / "model.safetensors").is_file()


def test_a_loss_that_does_not_fit_the_data_is_refused_before_the_model_loads(tiny_model_dir, tmp_path):
    cfg = reward_config(tiny_model_dir, tmp_path, data="smart_home_reward", loss="bradley_terry")
    cfg["model"]["base_model"] = str(tmp_path / "no-such-model")
    with pytest.raises(DataError, match="reward.loss bradley_terry needs preference pairs"):
        run(load_config(cfg), create_backend("cpu"), echo=lambda *_: None)


def test_process_reward_model_reports_step_accuracy_and_reloads(tiny_model_dir, tmp_path):
    from transformers import AutoModelForTokenClassification

    cfg = reward_config(tiny_model_dir, tmp_path, method="prm", data="arithmetic_prm")
    result = run(load_config(cfg), create_backend("cpu"), echo=lambda *_: None)
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert "step_accuracy" in rows[0] and result.after.accuracy_name == "step_accuracy"
    model = AutoModelForTokenClassification.from_pretrained(str(result.output_dir))
    assert model.config.num_labels == 2

    path = tmp_path / "prm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = CliRunner().invoke(main, ["score", str(path), "--data", str(QUICKSTART_DATA / "arithmetic_prm_val.jsonl")])
    assert res.exit_code == 0, res.output
    first = json.loads(res.stdout.splitlines()[0])
    assert len(first["step_scores"]) == len(first["labels"]) == 3
    assert all(0.0 <= p <= 1.0 for p in first["step_scores"])
    assert "step accuracy" in res.stderr


def test_score_prints_one_line_per_record(tiny_model_dir, tmp_path):
    cfg = reward_config(tiny_model_dir, tmp_path)
    cfg["training"]["max_steps"] = 1
    cfg["data"]["val_datasets"] = []
    path = tmp_path / "rm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    runner = CliRunner()
    missing = runner.invoke(main, ["score", str(path), "--data", str(QUICKSTART_DATA / "sample_reward.jsonl")])
    assert missing.exit_code == 2 and "holds no trained model" in missing.output
    assert runner.invoke(main, ["run", "-c", str(path)]).exit_code == 0
    pairs = runner.invoke(main, ["score", str(path), "--data", str(QUICKSTART_DATA / "sample_preference.jsonl")])
    assert pairs.exit_code == 0, pairs.output
    rows = [json.loads(line) for line in pairs.stdout.splitlines()]
    assert len(rows) == 3 and {"chosen", "rejected", "chosen_wins"} <= rows[0].keys()
    assert "chosen scored higher in" in pairs.stderr
    scores = runner.invoke(main, ["score", str(path), "--data", str(QUICKSTART_DATA / "sample_reward.jsonl")])
    assert [set(json.loads(line)) for line in scores.stdout.splitlines()] == [{"source", "score", "label"}] * 3
    assert "mean squared error" in scores.stderr


def test_merge_refuses_a_reward_model(tiny_model_dir, tmp_path):
    path = tmp_path / "rm.yaml"
    path.write_text(yaml.safe_dump(reward_config(tiny_model_dir, tmp_path)))
    res = CliRunner().invoke(main, ["merge", "-c", str(path)])
    assert res.exit_code == 2 and "already holds the whole model" in res.output
