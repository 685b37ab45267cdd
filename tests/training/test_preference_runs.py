"""Preference runs end to end on the tiny model: configs, logged metrics, reference handling, bad input."""

from __future__ import annotations

import json
import os
import signal

import pytest
import yaml
from click.testing import CliRunner

from mudpuppy import create_backend, load_config, run
from mudpuppy.cli import main
from mudpuppy.errors import ConfigError

from ..conftest import QUICKSTART_DATA, REPO

CONFIGS = ["dpo", "ipo", "simpo", "orpo", "kto", "rm", "prm"]
REWARD_KEYS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")


def quiet(*_):
    pass


def preference_config(tiny_model_dir, tmp_path, kind: str = "dpo", data: str = "smart_home_pref", **pref) -> dict:
    return {
        "model": {"base_model": str(tiny_model_dir)},
        "backend": "cpu",
        "method": "preference",
        "preference": {"type": kind, **pref},
        "adapter": {"type": "lora", "r": 4, "alpha": 8},
        "data": {"datasets": [{"path": str(QUICKSTART_DATA / f"{data}_train.jsonl"), "num_samples": 16}],
                 "val_datasets": [{"path": str(QUICKSTART_DATA / f"{data}_val.jsonl"), "num_samples": 8}],
                 "sequence_len": 128, "cache": False},
        "training": {"max_steps": 2, "micro_batch_size": 4, "learning_rate": 5e-3, "precision": "fp32", "seed": 1},
        "eval": {"batch_size": 8},
        "output_dir": str(tmp_path / f"run-{kind}"),
        "logging": {"progress_bar": False},
    }


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_config_validates_and_names_its_command(name):
    path = REPO / "configs" / f"{name}.yaml"
    assert path.read_text().startswith(f"# mudpuppy run --config configs/{name}.yaml")
    cfg = load_config(path)          # also checks that the data files exist
    assert cfg.model.base_model == "smollm2-135m-instruct"
    assert cfg.data_method() == name
    assert cfg.data.val_datasets, "every method config reports held-out numbers"


@pytest.mark.parametrize("kind", ["dpo", "ipo", "simpo", "orpo", "kto"])
def test_each_preference_type_trains_and_logs_rewards(kind, tiny_model_dir, tmp_path):
    data = "smart_home_kto" if kind == "kto" else "smart_home_pref"
    result = run(load_config(preference_config(tiny_model_dir, tmp_path, kind, data)), create_backend("cpu"),
                 echo=quiet)
    rows = [r for r in metrics(result.output_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert all(key in row for key in ("loss", "reward_accuracy", "reward_margin"))
    if kind != "kto":
        assert all(key in rows[0] for key in REWARD_KEYS)
    summary = json.loads((result.output_dir / "run_summary.json").read_text())
    assert summary["objective"] == kind and summary["eval_after"]["accuracy_name"] == "reward_accuracy"
    assert (result.output_dir / "adapter_model.safetensors").is_file()


def test_precomputed_reference_gives_the_same_first_loss(tiny_model_dir, tmp_path):
    losses = []
    for precompute in (False, True):
        cfg = preference_config(tiny_model_dir, tmp_path / str(precompute), "dpo", precompute_ref=precompute)
        cfg["training"]["max_steps"] = 2
        result = run(load_config(cfg), create_backend("cpu"), echo=quiet)
        losses.append(result.losses)
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)


def test_full_fine_tuning_needs_precomputed_reference(tiny_model_dir, tmp_path):
    cfg = preference_config(tiny_model_dir, tmp_path, "kto", "smart_home_kto")
    cfg["adapter"] = {"type": "none"}
    with pytest.raises(ConfigError, match="precompute_ref: true"):
        load_config(cfg)
    cfg["preference"]["precompute_ref"] = True
    result = run(load_config(cfg), create_backend("cpu"), echo=quiet)
    assert result.steps == 2 and (result.output_dir / "model.safetensors").is_file()


# --------------------------------------------------------------------------- bad input

def test_sft_data_given_to_dpo_fails_before_any_model_loads(tmp_path):
    cfg = {"model": {"base_model": str(tmp_path / "no-such-model")}, "method": "preference",
           "preference": {"type": "dpo"},
           "data": {"datasets": [{"path": str(QUICKSTART_DATA / "smart_home_train.jsonl")}]},
           "output_dir": str(tmp_path / "out")}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = CliRunner().invoke(main, ["run", "-c", str(path)])
    assert res.exit_code == 2
    # One message: the method, the format found, the fields expected; nothing about the (missing) model.
    assert "method 'dpo' cannot train on 'chat' data" in res.output
    assert "'prompt', 'chosen', 'rejected'" in res.output
    assert "no-such-model" not in res.output and not (tmp_path / "out").exists()


def write_bad_pairs(path):
    prompt = "Classify: turn on the kitchen lights"
    rows = [
        {"prompt": prompt, "chosen": "lights_on", "rejected": "lights_off"},
        {"prompt": "Classify: lock the door", "chosen": "door_lock", "rejected": "door_unlock"},
        {"prompt": prompt, "chosen": "lights_on", "rejected": "lights_on"},            # identical
        {"prompt": prompt, "chosen": "   ", "rejected": "lights_off"},                 # empty completion
        {"prompt": "word " * 200, "chosen": "lights_on", "rejected": "lights_off"},    # no room left
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def bad_pair_config(tiny_model_dir, tmp_path, policy: str) -> dict:
    data = tmp_path / "pairs.jsonl"
    write_bad_pairs(data)
    cfg = preference_config(tiny_model_dir, tmp_path, "dpo", bad_pairs=policy)
    cfg["data"] = {"datasets": [{"path": str(data), "prompt_style": "raw"}], "sequence_len": 64, "cache": False}
    cfg["training"]["max_steps"] = 1
    return cfg


def test_bad_pairs_are_counted_reported_and_dropped(tiny_model_dir, tmp_path):
    lines = []
    result = run(load_config(bad_pair_config(tiny_model_dir, tmp_path, "drop")), create_backend("cpu"),
                 echo=lines.append)
    report = next(line for line in lines if "train /" in line)
    assert report.startswith("dpo (beta 0.1, reference: adapter off): 2 train / 0 held-out examples")
    assert "1 chosen and rejected are identical" in report and "1 empty completion" in report
    assert "1 with no room for the completion within sequence_len 64" in report
    summary = json.loads((result.output_dir / "run_summary.json").read_text())
    assert summary["train_examples"] == 2
    assert summary["dropped"] == {"chosen and rejected are identical": 1, "empty completion": 1,
                                  "no room within sequence_len": 1}


def test_bad_pairs_policy_error_names_them_before_the_model_loads(tiny_model_dir, tmp_path):
    cfg = bad_pair_config(tiny_model_dir, tmp_path, "error")
    cfg["model"]["base_model"] = str(tmp_path / "no-such-model")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = CliRunner().invoke(main, ["run", "-c", str(path)])
    assert res.exit_code == 2, res.output
    assert "2 records would teach nothing" in res.output
    assert "pairs.jsonl:3: chosen and rejected are identical" in res.output
    assert "pairs.jsonl:4: empty completion" in res.output and "no-such-model" not in res.output


def test_prompt_filling_sequence_len_is_refused_by_policy(tiny_model_dir, tmp_path):
    data = tmp_path / "pairs.jsonl"
    cfg = bad_pair_config(tiny_model_dir, tmp_path, "error")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    data.write_text("".join(json.dumps(r) + "\n" for i, r in enumerate(rows) if i not in (2, 3)))
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = CliRunner().invoke(main, ["run", "-c", str(path)])
    assert res.exit_code == 2, res.output
    assert "1 examples leave no room for the completion within data.sequence_len (64)" in res.output


def test_sections_belong_to_their_method(tiny_model_dir, tmp_path):
    cfg = preference_config(tiny_model_dir, tmp_path)
    cfg["method"] = "sft"
    cfg["reward"] = {"loss": "mse"}
    cfg["data"]["packing"] = True
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert "preference: this section applies to method: preference" in str(err.value)
    assert "reward: this section applies to method: rm or prm" in str(err.value)
    cfg = preference_config(tiny_model_dir, tmp_path)
    cfg["data"]["packing"] = True
    with pytest.raises(ConfigError, match="data.packing: packing is for sft"):
        load_config(cfg)


class _CtrlC:
    """The cpu backend, with Ctrl-C arriving during the n-th optimizer step."""

    def __init__(self, inner, at_call):
        self.inner, self.at_call, self.calls = inner, at_call, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def create_trainer(self, handle, cfg):
        trainer = self.inner.create_trainer(handle, cfg)
        step = trainer.step

        def interrupting(*args):
            self.calls += 1
            if self.calls == self.at_call:
                os.kill(os.getpid(), signal.SIGINT)    # Ctrl-C: the step completes, then the loop stops
            return step(*args)

        trainer.step = interrupting
        return trainer


def test_resume_continues_exactly_with_a_precomputed_reference(tiny_model_dir, tmp_path):
    """Full fine-tuning: the reference is recomputed from the base weights before the checkpoint's
    weights load, so a resumed run matches an uninterrupted one step for step."""
    from mudpuppy.training.loop import Interrupted

    def config(out):
        cfg = preference_config(tiny_model_dir, tmp_path, "kto", "smart_home_kto", precompute_ref=True)
        cfg["adapter"] = {"type": "none"}
        cfg["training"].update(max_steps=4, save_steps=2)
        cfg["eval"] = {"before_training": False, "after_training": False}
        cfg["output_dir"] = str(tmp_path / out)
        return cfg

    straight = run(load_config(config("straight")), create_backend("cpu"), echo=quiet)
    with pytest.raises(Interrupted):
        run(load_config(config("broken")), _CtrlC(create_backend("cpu"), at_call=3), echo=quiet)
    resumed = run(load_config({**config("broken"), "resume": True}), create_backend("cpu"), echo=quiet)
    assert resumed.resumed_from == 3
    a = [r["loss"] for r in metrics(straight.output_dir) if "loss" in r]
    b = [r["loss"] for r in metrics(resumed.output_dir) if "loss" in r]
    assert a == pytest.approx(b, abs=1e-6) and len(b) == 4


def test_a_preference_run_merges_as_sft_does(tiny_model_dir, tmp_path):
    """merge: true on a DPO run: output_dir/merged from the saved adapter on a fresh fp32 base, with its card,
    and the logits of the base with the adapter (not a merge into the training-precision weights in place)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mudpuppy import create_backend, load_config, run

    cfg = preference_config(tiny_model_dir, tmp_path)
    cfg.update(merge=True, merge_dtype="float32")
    result = run(load_config(cfg), create_backend("cpu"), echo=lambda *_: None)
    merged_dir = result.output_dir / "merged"
    assert "written by `mudpuppy merge`" in (merged_dir / "README.md").read_text()
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    base = AutoModelForCausalLM.from_pretrained(cfg["model"]["base_model"], dtype=torch.float32)
    with torch.no_grad():
        expected = PeftModel.from_pretrained(base, str(result.output_dir)).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()(ids).logits
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=0)
