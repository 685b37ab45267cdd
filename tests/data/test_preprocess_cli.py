"""`mudpuppy preprocess`: caches, reports, shows the masking, and fails in one line on bad data."""

from __future__ import annotations

import yaml
from click.testing import CliRunner

from mudpuppy.cli import main

from .conftest import SAMPLES


def write_config(tmp_path, model_dir, datasets, **data):
    cfg = {
        "model": {"base_model": str(model_dir)},
        "data": {"datasets": datasets, "sequence_len": 128, "cache_dir": str(tmp_path / "cache"), **data},
        "training": {"micro_batch_size": 4},
        "output_dir": str(tmp_path / "out"),
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_preprocess_caches_reports_and_marks_samples(tmp_path, tiny_model_dir):
    cfg = write_config(tmp_path, tiny_model_dir, [{"path": str(SAMPLES / "smart_home_train.jsonl"), "num_samples": 50}],
                       val_set_size=10)
    runner = CliRunner()
    first = runner.invoke(main, ["preprocess", str(cfg), "--samples", "1"])
    assert first.exit_code == 0, first.output
    out = first.output
    assert "cache: tokenized and saved to" in out
    assert "smart_home_train.jsonl: chat, 50 examples" in out
    assert "train: 40 examples; validation: 10 examples" in out
    assert "p50" in out and "p99" in out and "max" in out
    assert "truncated: 0; dropped: 0" in out and "loss-carrying tokens:" in out
    assert "packing:" in out and "batching (micro_batch_size 4, padded)" in out
    assert "<|im_start|>assistant\n[[" in out and "<|im_end|>]]" in out

    second = runner.invoke(main, ["preprocess", str(cfg), "-n", "0"])
    assert second.exit_code == 0, second.output
    assert "cache: reused" in second.output and "nothing was re-tokenized" in second.output
    assert "train: 40 examples; validation: 10 examples" in second.output and "[[" not in second.output

    refreshed = runner.invoke(main, ["preprocess", str(cfg), "--refresh", "--set", "data.packing=true"])
    assert "cache: tokenized and saved" in refreshed.output and "packed rows of 128" in refreshed.output


def test_bad_data_is_one_line_and_exit_2(tmp_path, tiny_model_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken\n')
    cfg = write_config(tmp_path, tiny_model_dir, [{"path": str(bad)}])
    result = CliRunner().invoke(main, ["preprocess", str(cfg)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "bad.jsonl:2: malformed JSON" in lines[0]


def test_a_method_format_mismatch_stops_before_the_tokenizer(tmp_path):
    cfg = write_config(tmp_path, tmp_path / "no-model-here", [{"path": str(SAMPLES / "sample_preference.jsonl")}])
    result = CliRunner().invoke(main, ["preprocess", str(cfg)])
    assert result.exit_code == 2
    assert "method 'sft' cannot train on 'preference' data" in result.output


def test_training_reuses_what_preprocess_cached(tmp_path, tiny_model_dir):
    """The tokenizer the torch backend loads hashes like the one preprocess loads."""
    import torch

    from mudpuppy.backends.torch.backend import DevicePlan, TorchBackend
    from mudpuppy.configure import load_config
    from mudpuppy.data import prepare_sft_data

    cfg_path = write_config(tmp_path, tiny_model_dir, [{"path": str(SAMPLES / "sample_instruction.jsonl")}])
    assert CliRunner().invoke(main, ["preprocess", str(cfg_path), "-n", "0"]).exit_code == 0
    cfg = load_config(cfg_path)
    tokenizer = TorchBackend(DevicePlan("cpu", torch.device("cpu"))).load_tokenizer(cfg.model, tiny_model_dir)
    assert prepare_sft_data(cfg, tokenizer).report.cache == "reused"
