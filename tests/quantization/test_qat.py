"""method: qat on a tiny model: fake quantization equals the converted model, the saved layout reads back
(also by a reader written here), fake_quant_after_n_steps, the CLI end to end, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from mudpuppy import create_backend, load_config, run
from mudpuppy.cli import main
from mudpuppy.quantization.kernels import QuantizedLinear
from mudpuppy.quantization.qat import (
    QatSpec, convert_qat, is_qat_checkpoint, load_quantized, prepare_qat, save_quantized, set_fake_quant,
)

# int8 activations: the converted model multiplies the integer codes (qgemm) where the fake-quantized one
# multiplies their float values, so the two differ by float rounding, which can move an activation code
# across a rounding boundary in a later layer. Measured on this tiny model: ~1e-6; the bound leaves room.
INT8_ACTIVATION_LOGIT_BOUND = 1e-4


def tiny_lm(model_dir, adapter: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        with torch.no_grad():                           # a trained-looking adapter, so merging matters
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
    return model.eval()


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("adapter,bits,activations", [
    ("lora", 4, "none"), ("none", 4, "none"), ("none", 8, "int8"), ("lora", 4, "int8")])
def test_fake_quantized_logits_equal_the_converted_models(tiny_model_dir, tmp_path, adapter, bits, activations):
    torch.manual_seed(1)
    model = tiny_lm(tiny_model_dir, adapter == "lora")
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    plain = logits(model, ids)
    spec = QatSpec(bits, 32 if bits == 4 else -1, activations)
    layers = prepare_qat(model, spec)
    assert len(layers.names()) == 14
    assert torch.equal(logits(model, ids), plain)          # switched off: the model's own computation
    set_fake_quant(model, True)
    fake = logits(model, ids)
    assert (fake - plain).abs().max() > 1e-3               # and on, it changes something
    converted = convert_qat(model, layers)
    assert sum(isinstance(m, QuantizedLinear) for m in converted.modules()) == 14
    out = logits(converted, ids)
    if activations == "none":
        assert torch.equal(out, fake)                      # the stated bound: bit for bit
    else:
        assert (out - fake).abs().max() <= INT8_ACTIVATION_LOGIT_BOUND
    save_quantized(converted, None, tmp_path / "q")
    assert is_qat_checkpoint(tmp_path / "q")
    assert torch.equal(logits(load_quantized(tmp_path / "q"), ids), out)


def test_saved_layout_read_by_an_independent_reader_gives_the_same_logits(tiny_model_dir, tmp_path):
    """Dequantize model.safetensors by the documented layout with numpy alone, into a plain transformers model."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(2)
    model = tiny_lm(tiny_model_dir, adapter=True)
    layers = prepare_qat(model, QatSpec(4, 32))
    converted = convert_qat(model, layers)
    converted.config.use_cache = False                   # as a training run loads it
    save_quantized(converted, None, tmp_path / "q")

    config = json.loads((tmp_path / "q" / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "mudpuppy_qat" and qc["weight_bits"] == 4 and qc["group_size"] == 32
    assert config["use_cache"] is True and converted.config.use_cache is False   # written on, left as it was
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    state = {}
    for key, value in tensors.items():
        name, _, leaf = key.rpartition(".")
        if name in qc["modules"] and leaf == "qweight":
            assert value.dtype == np.uint8
            codes = np.stack([(value & 0x0F).astype(np.int16) - 8, (value >> 4).astype(np.int16) - 8], -1)
            codes = codes.reshape(value.shape[0], -1)
            scales = tensors[f"{name}.scales"]
            assert scales.dtype == np.float32 and scales.shape == (codes.shape[0], codes.shape[1] // 32)
            weight = codes.astype(np.float32) * np.repeat(scales, 32, axis=1)
            state[f"{name}.weight"] = torch.from_numpy(weight)
        elif leaf != "scales":
            state[key] = torch.from_numpy(value.copy())
    plain_config = AutoConfig.from_pretrained(str(tiny_model_dir))
    reader = AutoModelForCausalLM.from_config(plain_config).eval()
    missing, unexpected = reader.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    reader.tie_weights()
    ids = torch.randint(0, plain_config.vocab_size, (2, 10))
    assert torch.equal(logits(reader, ids), logits(converted, ids))


def write_cfg(tmp_path, cfg, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def qat_config(tiny_config, **qat):
    tiny_config["method"] = "qat"
    tiny_config["qat"] = {"weight_bits": 4, "group_size": 32, **qat}
    tiny_config["training"]["max_steps"] = 3
    tiny_config["eval"] = {"before_training": False, "exact_match": False, "batch_size": 16}
    return tiny_config


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "loss" in line]


def test_cli_qat_run_end_to_end_with_fake_quant_after_n_steps(tiny_config, tmp_path):
    cfg = qat_config(tiny_config, fake_quant_after_n_steps=1)
    res = CliRunner().invoke(main, ["run", "-c", str(write_cfg(tmp_path, cfg))])
    assert res.exit_code == 0, res.output
    out = tmp_path / "run"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "run_summary.json", "ptq_baseline.json",
                 "trained/adapter_model.safetensors"):
        assert (out / name).is_file(), name
    assert not (out / "qat-branch-point").exists()
    assert "PTQ round-to-nearest" in res.output and "QAT converted" in res.output
    summary = json.loads((out / "run_summary.json").read_text())
    held = summary["qat"]["heldout"]
    assert all(held[k]["loss"] > 0 for k in ("fine_tuned_float", "ptq_round_to_nearest", "qat_fake_quantized",
                                             "qat_converted"))
    assert held["qat_converted"]["loss"] == held["qat_fake_quantized"]["loss"]      # weight-only: bit for bit
    assert summary["eval_after"]["loss"] == held["qat_converted"]["loss"]
    assert is_qat_checkpoint(out)

    # The same config as plain SFT: step 1 (before fake quantization) is identical, steps 2-3 are not;
    # the PTQ baseline is that SFT run exactly, so its last loss is SFT's.
    sft = dict(cfg, method="sft", output_dir=str(tmp_path / "sft"))
    del sft["qat"]
    plain = run(load_config(write_cfg(tmp_path, sft, "sft.yaml")), create_backend("cpu"), echo=lambda *_: None)
    qat_losses = [r["loss"] for r in metrics(out)]
    assert len(qat_losses) == 3
    assert qat_losses[0] == round(plain.losses[0], 6)
    assert qat_losses[1] != round(plain.losses[1], 6) and qat_losses[2] != round(plain.losses[2], 6)
    assert summary["qat"]["ptq_baseline_run"]["final_train_loss"] == plain.losses[-1]


def test_full_fine_tuning_with_int8_activations_and_no_held_out_data(tiny_config, tmp_path):
    cfg = qat_config(tiny_config, weight_bits=8, group_size=-1, activations="int8")
    cfg["adapter"] = {"type": "none"}
    cfg["training"]["max_steps"] = 2
    del cfg["data"]["val_datasets"]
    result = run(load_config(write_cfg(tmp_path, cfg)), create_backend("cpu"), echo=lambda *_: None)
    out = result.output_dir
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["qat"]["heldout"] is None and not (out / "ptq_baseline.json").exists()
    assert (out / "trained" / "model.safetensors").is_file()
    converted = result.model.model
    ids = torch.randint(0, converted.config.vocab_size, (1, 9))
    assert torch.equal(logits(load_quantized(out), ids), logits(converted, ids))
    layer = converted.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantizedLinear) and layer.activations == "int8" and layer.scales.shape[1] == 1


@pytest.mark.parametrize("change,words", [
    ({"qat": {"group_size": 64}}, "qat.group_size: 64 does not divide"),
    ({"adapter": {"type": "dora"}}, "adapter.type dora"),
    ({"adapter": {"type": "lora", "dropout": 0.1}}, "adapter.dropout"),
    ({"backend": "mlx"}, "--backend cpu"),
])
def test_bad_qat_settings_fail_before_anything_is_written(tiny_config, tmp_path, change, words):
    cfg = qat_config(tiny_config)
    for key, value in change.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    res = CliRunner().invoke(main, ["run", "-c", str(write_cfg(tmp_path, cfg))])
    assert res.exit_code == 2, res.output
    assert words in res.output and "Traceback" not in res.output
    assert not (tmp_path / "run").exists()


def test_loading_something_that_is_not_a_qat_model_says_so(tiny_model_dir):
    from mudpuppy.errors import MudpuppyError

    assert not is_qat_checkpoint(tiny_model_dir)
    with pytest.raises(MudpuppyError, match="not a mudpuppy QAT model"):
        load_quantized(tiny_model_dir)


def test_a_converted_qat_run_is_evaluated_as_saved_and_refused_as_a_training_base(tiny_config, tmp_path):
    """transformers alone skips the unknown quantization_config and leaves the quantized layers random;
    mudpuppy's loader reads the codes, so `mudpuppy eval` measures what the run measured after conversion."""
    import math

    cfg = qat_config(tiny_config, fake_quant_after_n_steps=1)
    assert CliRunner().invoke(main, ["run", "-c", str(write_cfg(tmp_path, cfg))]).exit_code == 0
    out = tmp_path / "run"
    held = json.loads((out / "run_summary.json").read_text())["qat"]["heldout"]["qat_converted"]
    val = cfg["data"]["val_datasets"][0]
    res = CliRunner().invoke(main, ["eval", str(out), "--data", val["path"], "--max-samples", str(val["num_samples"]),
                                    "--metrics", "perplexity", "--backend", "cpu", "--precision", "fp32"])
    assert res.exit_code == 0, res.output
    assert "QAT int4 model (converted)" in res.output
    [measured] = json.loads((out / "eval" / "eval.json").read_text())["models"]
    assert math.isclose(measured["values"]["perplexity"], math.exp(held["loss"]), rel_tol=1e-4)

    sft = dict(cfg, method="sft", output_dir=str(tmp_path / "again"), model={"base_model": str(out)})
    del sft["qat"]
    res = CliRunner().invoke(main, ["run", "-c", str(write_cfg(tmp_path, sft, "again.yaml"))])
    assert res.exit_code == 2 and "is a converted QAT model" in res.output and "trained/" in res.output, res.output
