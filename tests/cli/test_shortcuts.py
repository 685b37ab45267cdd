"""Runs without YAML: `mudpuppy train MODEL DATA --method ...`, `mudpuppy init`, and `mudpuppy run CONFIG`."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from mudpuppy.cli import main
from mudpuppy.configure import load_config
from mudpuppy.shortcuts import train_config

from ..conftest import QUICKSTART_DATA

TRAIN = str(QUICKSTART_DATA / "smart_home_train.jsonl")
VAL = str(QUICKSTART_DATA / "smart_home_val.jsonl")


def test_train_runs_and_leaves_a_config_that_reruns(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["train", str(tiny_model_dir), TRAIN, "--method", "lora", "--output", str(out),
                                    "--backend", "cpu", "--max-steps", "2", "--batch-size", "4",
                                    "--sequence-len", "128", "--lora-r", "4", "--precision", "fp32"])
    assert res.exit_code == 0, res.output
    assert (out / "run_summary.json").exists() and (out / "adapter_model.safetensors").exists()
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["adapter"]["r"] == 4 and saved["training"]["max_steps"] == 2
    assert CliRunner().invoke(main, ["validate", str(out / "config.yaml")]).exit_code == 0


def test_write_config_then_run_it_positionally(tiny_model_dir, tmp_path):
    cfg_path = tmp_path / "made.yaml"
    res = CliRunner().invoke(main, ["train", str(tiny_model_dir), TRAIN, "--method", "full", "--output",
                                    str(tmp_path / "full"), "--max-steps", "1", "--batch-size", "2",
                                    "--sequence-len", "64", "--write-config", str(cfg_path)])
    assert res.exit_code == 0, res.output
    assert cfg_path.read_text().startswith(f"# mudpuppy run --config {cfg_path}\n")
    assert load_config(cfg_path).adapter.type == "none"
    again = CliRunner().invoke(main, ["train", str(tiny_model_dir), TRAIN, "--write-config", str(cfg_path)])
    assert again.exit_code == 2 and "the file exists" in again.output
    res = CliRunner().invoke(main, ["run", str(cfg_path), "--backend", "cpu"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "full" / "model.safetensors").exists()


def test_run_needs_exactly_one_config(tmp_path):
    res = CliRunner().invoke(main, ["run"])
    assert res.exit_code == 2 and "no config: mudpuppy run CONFIG.yaml" in res.output
    res = CliRunner().invoke(main, ["run", "a.yaml", "-c", "b.yaml"])
    assert res.exit_code == 2 and "two configs given" in res.output


@pytest.mark.parametrize("flags, expect", [
    (["--method", "full"], {"method": "sft", "adapter": {"type": "none"}}),
    (["--method", "qlora", "--quant-backend", "mxfp4"], {"adapter": {"type": "qlora", "quant_backend": "mxfp4"}}),
    (["--method", "preference", "--preference", "orpo"], {"method": "preference", "preference": {"type": "orpo"}}),
    (["--method", "kto"], {"preference": {"type": "kto"}}),
    (["--method", "rl", "--reward", "exact_match", "--reward", "contains"],
     {"method": "grpo", "grpo": {"reward_funcs": ["exact_match", "contains"]}}),
    (["--stream", "--zero-offload"], {"memory": {"stream_layers": True, "optimizer_offload": True}}),
    (["--merge-lora", "--merge-precision", "fp16"], {"merge": True, "merge_dtype": "float16"}),
    (["--early-stopping", "3"], {"training": {"early_stopping_patience": 3, "eval_steps": 50},
                                 "data": {"val_set_size": 0.05}}),
    (["--lora-targets", "q_proj, v_proj", "--log-with", "tensorboard"],
     {"adapter": {"target_modules": ["q_proj", "v_proj"]}, "logging": {"report_to": ["tensorboard"]}}),
])
def test_seed_flags_map_onto_config_keys(flags, expect):
    from mudpuppy.cli import train

    ctx = train.make_context("train", ["m", TRAIN, *flags])
    p = ctx.params
    raw = train_config(p["model"], p["data"], p["method"], p["output"], preference=p["preference"],
                       quant_backend=p["quant_backend"], rewards=p["rewards"], stream=p["stream"],
                       zero_offload=p["zero_offload"], merge_lora=p["merge_lora"],
                       merge_precision=p["merge_precision"], early_stopping=p["early_stopping"],
                       lora_targets=p["lora_targets"], log_with=p["log_with"])

    def contains(big, small):
        return all(contains(big[k], v) if isinstance(v, dict) else big[k] == v for k, v in small.items())

    assert contains(raw, expect), raw
    load_config(raw)                     # every mapping is a valid config


@pytest.mark.parametrize("flags, message", [
    (["--method", "sorcery"], "--method sorcery: not a method"),
    (["--method", "lora", "--quant-backend", "int4"], "--quant-backend applies to --method qlora"),
    (["--epochs", "2", "--max-steps", "3"], "--epochs and --max-steps: give one of them"),
    (["--method", "lora", "--preference", "dpo"], "--preference applies to preference methods"),
    (["--learning-rate", "-1"], "training.learning_rate"),
])
def test_bad_flags_get_one_message_and_exit_2(tiny_model_dir, flags, message, tmp_path):
    res = CliRunner().invoke(main, ["train", str(tiny_model_dir), TRAIN, "--output", str(tmp_path / "o"), *flags])
    assert res.exit_code == 2 and message in res.output, res.output
    assert not (tmp_path / "o").exists()


def test_missing_data_is_named(tiny_model_dir, tmp_path):
    res = CliRunner().invoke(main, ["train", str(tiny_model_dir), str(tmp_path / "nope.jsonl")])
    assert res.exit_code == 2 and "DATA:" in res.output and "does not exist" in res.output


def test_init_from_flags_writes_a_commented_config_that_validates_and_never_overwrites(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(Path(TRAIN).read_text())
    target = tmp_path / "cfg" / "my.yaml"
    res = CliRunner().invoke(main, ["init", str(target), "--data", str(data / "train.jsonl"), "--method", "orpo",
                                    "--yes"])
    assert res.exit_code == 0, res.output
    text = target.read_text()
    assert text.startswith(f"# mudpuppy run --config {target}")
    assert "type: orpo" in text and "# lora, dora, qlora" in text
    cfg = load_config(target)
    assert cfg.preference.type == "orpo" and cfg.output_dir == "outputs/orpo"
    assert cfg.resolve_path(cfg.data.datasets[0].path) == (data / "train.jsonl").resolve()
    before = target.read_text()
    res = CliRunner().invoke(main, ["init", str(target), "--data", TRAIN, "--yes"])
    assert res.exit_code == 2 and "never overwrites" in res.output
    assert target.read_text() == before
    res = CliRunner().invoke(main, ["init", str(tmp_path / "x.yaml"), "--yes"])
    assert res.exit_code == 2 and "--data" in res.output


def test_init_asks_on_a_terminal(tmp_path):
    target = tmp_path / "asked.yaml"
    pid, fd = pty.fork()
    if pid == 0:                                          # the child: mudpuppy init on a terminal
        os.chdir(tmp_path)
        os.execv(sys.executable, [sys.executable, "-m", "mudpuppy", "init", str(target)])
    answers = ["", TRAIN, "qlora", "cpu", "outputs/q"]
    seen, deadline = b"", time.time() + 120
    while answers and time.time() < deadline:
        ready, _, _ = select.select([fd], [], [], 1)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            seen += chunk
            if chunk.rstrip().endswith((b":", b"]:")):
                os.write(fd, answers.pop(0).encode() + b"\r")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, seen.decode(errors="replace")
    assert b"Base model" in seen and b"Method" in seen
    cfg = load_config(target)
    assert cfg.adapter.type == "qlora" and cfg.backend == "cpu" and cfg.model.base_model == "smollm2-135m-instruct"
    assert cfg.output_dir == "outputs/q"
