"""LoRA SFT end to end on a tiny model: the CLI, what is saved, and that it reloads exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from mudpuppy import create_backend, load_config, run
from mudpuppy.cli import main
from mudpuppy.data import collate


def write_cfg(tmp_path, cfg):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_cli_run_writes_a_complete_run(tiny_config, tmp_path):
    res = CliRunner().invoke(main, ["run", "--config", str(write_cfg(tmp_path, tiny_config))])
    assert res.exit_code == 0, res.output
    out = tmp_path / "run"
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json",
                 "config.yaml", "metrics.jsonl", "run_summary.json"):
        assert (out / name).is_file(), name
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    for key in ("loss", "lr", "tokens_per_second", "elapsed", "grad_norm"):
        assert all(key in r for r in rows)
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 6
    assert "held-out loss" in res.output and "exact match" in res.output
    # The saved config is the resolved one and validates again.
    assert load_config(out / "config.yaml", check_files=False).training.max_steps == 6


def test_a_finished_run_is_never_overwritten_without_the_flag(tiny_config, tmp_path):
    path = write_cfg(tmp_path, tiny_config)
    runner = CliRunner()
    assert runner.invoke(main, ["run", "-c", str(path)]).exit_code == 0
    adapter = tmp_path / "run" / "adapter_model.safetensors"
    before = adapter.read_bytes()
    again = runner.invoke(main, ["run", "-c", str(path), "--set", "training.learning_rate=0.1"])
    assert again.exit_code == 2
    assert "already holds a finished run" in again.output and "--overwrite" in again.output
    assert adapter.read_bytes() == before
    forced = runner.invoke(main, ["run", "-c", str(path), "--overwrite", "--set", "training.learning_rate=0.1"])
    assert forced.exit_code == 0, forced.output
    assert adapter.read_bytes() != before


def test_overwrite_refuses_a_directory_that_is_not_a_run(tiny_config, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "thesis.tex").write_text("years of work")
    res = CliRunner().invoke(main, ["run", "-c", str(write_cfg(tmp_path, tiny_config)), "--overwrite"])
    assert res.exit_code == 2 and "does not look like a mudpuppy run" in res.output
    assert (tmp_path / "run" / "thesis.tex").read_text() == "years of work"


def test_saved_adapter_loads_with_plain_peft_and_reproduces_logits(tiny_config, tiny_model_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    backend = create_backend("cpu")
    result = run(load_config(tiny_config), backend, echo=lambda *_: None)
    handle = result.model
    ex = [collate([e], handle.tokenizer.pad_token_id) for e in []]  # noqa: F841 (kept simple below)
    ids = handle.tokenizer("<|im_start|>user\nturn on the kitchen lights<|im_end|>\n", add_special_tokens=False)["input_ids"]
    batch_ids = torch.tensor([ids])
    trained = backend.logits(handle, _batch(ids))

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, str(result.output_dir)).eval()
    with torch.no_grad():
        plain = reloaded(input_ids=batch_ids).logits.numpy()
        untouched = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))(input_ids=batch_ids).logits.numpy()
    np.testing.assert_allclose(plain, trained, atol=1e-5, rtol=0)
    assert np.abs(plain - untouched).max() > 1e-4, "training changed nothing"


def _batch(ids):
    from mudpuppy.data import Example

    return collate([Example(np.asarray(ids, dtype=np.int32), np.ones(len(ids), dtype=bool))], 0)


@pytest.mark.parametrize("adapter", ["lora", "dora", "none", "qlora-int4", "qlora-mxfp4"])
def test_each_adapter_kind_reduces_training_loss(tiny_config, adapter):
    kind, _, quant = adapter.partition("-")
    tiny_config["adapter"] = {"type": kind, "r": 8, "alpha": 16, **({"quant_backend": quant} if quant else {})}
    tiny_config["training"].update(max_steps=15, lr_scheduler="constant",
                                   learning_rate=3e-2 if kind != "none" else 1e-2)
    tiny_config["data"]["datasets"][0]["num_samples"] = 8      # one fixed small set, seen repeatedly
    tiny_config["eval"] = {"before_training": False, "after_training": False}
    result = run(load_config(tiny_config), create_backend("cpu"), echo=lambda *_: None)
    first, last = np.mean(result.losses[:3]), np.mean(result.losses[-3:])
    assert last < first * 0.8, (adapter, result.losses)


def test_full_finetune_saves_a_model_transformers_loads(tiny_config):
    from transformers import AutoModelForCausalLM

    tiny_config["adapter"] = {"type": "none"}
    tiny_config["training"]["max_steps"] = 2
    result = run(load_config(tiny_config), create_backend("cpu"), echo=lambda *_: None)
    model = AutoModelForCausalLM.from_pretrained(str(result.output_dir))
    assert model.config.num_hidden_layers == 2


def test_gradient_accumulation_matches_one_large_batch(tiny_config):
    """Token-weighted accumulation: 2 x 4 micro-batches give the same update as 1 x 8."""
    tiny_config["eval"] = {"before_training": False, "after_training": False}
    tiny_config["data"]["shuffle"] = False
    tiny_config["training"].update(max_steps=3, optimizer="sgd", max_grad_norm=None, warmup_steps=0)
    one = dict(tiny_config, training=dict(tiny_config["training"], micro_batch_size=8, gradient_accumulation_steps=1))
    two = dict(tiny_config, training=dict(tiny_config["training"], micro_batch_size=4, gradient_accumulation_steps=2),
               output_dir=tiny_config["output_dir"] + "-acc")
    a = run(load_config(one), create_backend("cpu"), echo=lambda *_: None)
    b = run(load_config(two), create_backend("cpu"), echo=lambda *_: None)
    np.testing.assert_allclose(a.losses, b.losses, rtol=1e-5)


def test_bad_data_fails_before_any_model_loads_or_output_is_written(tiny_config, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                   '{"messages": [oops}\n')
    tiny_config["data"]["datasets"] = [{"path": str(bad)}]
    tiny_config["model"]["base_model"] = str(tmp_path / "no-such-model")   # never reached
    res = CliRunner().invoke(main, ["run", "-c", str(write_cfg(tmp_path, tiny_config))])
    assert res.exit_code == 2
    assert "bad.jsonl:2" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "run").exists()


def test_qlora_quantizes_the_base_and_merges_into_the_weights_it_trained_on(tiny_config, tiny_model_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mudpuppy.backends.torch.quantization.linear4bit import quantize_model

    tiny_config["adapter"] = {"type": "qlora", "r": 4, "alpha": 8, "quant_backend": "int4", "quant_group_size": 16}
    tiny_config["training"].update(max_steps=4, learning_rate=3e-2)
    tiny_config["eval"] = {"before_training": False, "after_training": False}
    tiny_config["merge"] = True
    tiny_config["merge_dtype"] = "float32"
    result = run(load_config(tiny_config), create_backend("cpu"), echo=lambda *_: None)
    merged_dir = result.output_dir / "merged"
    assert not any(name.endswith(("qweight", "scales", "mins")) for name in _safetensor_keys(merged_dir))
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    # Reference: quantize a fresh base the same way, attach the saved adapter with plain PEFT.
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    quantize_model(base, "int4", 16)
    with torch.no_grad():
        want = PeftModel.from_pretrained(base, str(result.output_dir)).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(str(result.output_dir / "merged")).eval()(input_ids=ids).logits
    torch.testing.assert_close(merged, want, atol=1e-5, rtol=0)


def test_qlora_options_are_checked():
    from mudpuppy.errors import ConfigError

    base = {"model": {"base_model": "m"}, "data": {"datasets": [{"path": "org/name"}]}, "output_dir": "o"}
    with pytest.raises(ConfigError, match="does not apply to mxfp4"):
        load_config({**base, "adapter": {"type": "qlora", "quant_backend": "mxfp4", "quant_group_size": 128}})
    with pytest.raises(ConfigError, match="must be even"):
        load_config({**base, "adapter": {"type": "qlora", "quant_group_size": 33}})
    assert load_config({**base, "adapter": {"type": "qlora", "quant_backend": "mxfp4"}}).adapter.quant_backend == "mxfp4"


def test_merge_command_rebuilds_the_qlora_base(tiny_config, tiny_model_dir, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mudpuppy.backends.torch.quantization.linear4bit import quantize_model

    tiny_config["adapter"] = {"type": "qlora", "r": 4, "alpha": 8, "quant_backend": "mxfp4"}
    tiny_config["training"].update(max_steps=3, learning_rate=3e-2)
    tiny_config["eval"] = {"before_training": False, "after_training": False}
    path = write_cfg(tmp_path, tiny_config)
    assert CliRunner().invoke(main, ["run", "-c", str(path)]).exit_code == 0
    res = CliRunner().invoke(main, ["merge", "-c", str(path), "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    quantize_model(base, "mxfp4")
    with torch.no_grad():
        want = PeftModel.from_pretrained(base, tiny_config["output_dir"]).eval()(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(tiny_config["output_dir"] + "/merged").eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _safetensor_keys(directory):
    from safetensors import safe_open

    keys = []
    for f in directory.glob("*.safetensors"):
        with safe_open(str(f), "np") as fh:
            keys += list(fh.keys())
    return keys


def test_qlora_never_quantizes_a_scalar_head(tiny_config):
    from mudpuppy.backends.torch.quantization.linear4bit import Linear4bit

    backend = create_backend("cpu", precision="fp32")
    cfg = load_config(tiny_config)
    handle = backend.load_model(cfg.model, "fp32", head="sequence_classification")
    backend.quantize_base(handle, cfg.adapter.model_copy(update={"type": "qlora"}))
    assert not isinstance(handle.model.score, Linear4bit)
    assert any(isinstance(m, Linear4bit) for m in handle.model.modules())


def test_generation_stops_only_on_tokens_the_vocabulary_has(tiny_model_dir):
    from transformers import AutoTokenizer

    from mudpuppy.evaluation.heldout import stop_token_ids

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    im_end = tok.get_vocab()["<|im_end|>"]
    assert stop_token_ids(tok) == [im_end]          # eos is <|im_end|> here; no unk id sneaks in
    assert tok.unk_token_id not in stop_token_ids(tok)
