"""`mudpuppy export --format peft`: the adapter for PEFT and mlx-lm elsewhere. After adapter.loftq_iter > 1
the 4-bit base the adapter trained against is not the checkpoint's, so the export carries that base
(dequantized, base/) and points the adapter at it, as PEFT's LoftQ example does; the oracle is plain
transformers + PEFT on the export computing what mudpuppy's own merged model of the run computes, where the
adapter alone on the checkpoint does not. Handing the adapter alone elsewhere (convert-adapter of the run,
its checkpoints) is refused for such a run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from .conftest import logits, mudpuppy, trained_run
from .test_cli import one_error

LOFTQ = {"type": "qlora", "r": 4, "alpha": 8, "init": "loftq", "loftq_iter": 2, "dropout": 0.0}
IDS = [5, 17, 42, 99, 3, 250, 77, 8, 131, 64, 12]


@pytest.fixture(scope="module")
def loftq_run(tiny_model_dir, tmp_path_factory) -> Path:
    """Two steps of QLoRA from LoftQ's 2-iteration start, a checkpoint after the first."""
    return trained_run(tmp_path_factory.mktemp("loftq-run"), tiny_model_dir,
                       dict(max_steps=2, learning_rate=5e-2, save_steps=1), adapter=LOFTQ)


@pytest.fixture(scope="module")
def merged_logits(loftq_run, tmp_path_factory):
    """mudpuppy's own merged model of the run (it rebuilds the changed base), read by transformers alone."""
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("merged") / "m"
    done = mudpuppy("export", loftq_run, "--format", "merged", "--dtype", "fp32", "--out", out)
    assert done.exit_code == 0, done.output
    return logits(AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval(), IDS)


@pytest.fixture(scope="module")
def peft_export(loftq_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("peft") / "exported"
    done = mudpuppy("export", loftq_run, "--format", "peft", "--out", out)
    assert done.exit_code == 0, done.output
    assert "base/" in done.output
    return out


def test_peft_on_the_exported_base_is_mudpuppy_s_merged_model(peft_export, merged_logits, loftq_run, tiny_model_dir):
    import torch
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((peft_export / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(peft_export.resolve() / "base")
    assert config["init_lora_weights"] is True           # PEFT loads it with no LoftQ step of its own
    base = AutoModelForCausalLM.from_pretrained(str(peft_export / "base"), dtype=torch.float32)
    ours = logits(PeftModel.from_pretrained(base, str(peft_export)).eval(), IDS)
    np.testing.assert_allclose(ours, merged_logits, atol=1e-5, rtol=0)
    # PEFT finding the base by itself, from base_model_name_or_path
    auto = logits(AutoPeftModelForCausalLM.from_pretrained(str(peft_export), dtype=torch.float32).eval(), IDS)
    np.testing.assert_allclose(auto, merged_logits, atol=1e-5, rtol=0)
    # What a user got before: the run's adapter alone, on the checkpoint's own weights, is another model.
    checkpoint = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    alone = logits(PeftModel.from_pretrained(checkpoint, str(loftq_run)).eval(), IDS)
    assert np.abs(alone - merged_logits).max() > 100 * 1e-5


def test_the_export_holds_the_changed_base_and_the_run_s_adapter(peft_export, loftq_run, tiny_model_dir):
    from safetensors.numpy import load_file

    original = load_file(str(tiny_model_dir / "model.safetensors"))
    base = load_file(str(peft_export / "base" / "model.safetensors"))
    assert base.keys() == original.keys()
    targets = [k for k in base if k.endswith(("q_proj.weight", "down_proj.weight"))]
    assert targets and all(not np.array_equal(base[k], original[k]) for k in targets)
    for key in ("model.embed_tokens.weight", "model.norm.weight"):
        np.testing.assert_array_equal(base[key], original[key])
    assert json.loads((peft_export / "base" / "config.json").read_text()).get("dtype") == "float32"
    ours, run = (load_file(str(d / "adapter_model.safetensors")) for d in (peft_export, loftq_run))
    assert ours.keys() == run.keys()
    for key, value in run.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)
    record = json.loads((peft_export / "export.json").read_text())
    assert record["format"] == "peft" and record["peft"]["loftq_iter"] == 2 and "base" in record["files"]
    mlx = json.loads((peft_export / "mlx" / "adapter_config.json").read_text())
    assert mlx["model"] == str(peft_export.resolve() / "base")
    assert "base/" in (peft_export / "README.md").read_text()


def test_mudpuppy_reads_the_export_as_an_adapter_on_its_base(peft_export):
    from mudpuppy.evaluation.targets import resolve_target

    column = resolve_target(str(peft_export), None, None)
    assert column.cfg.model.base_model == str(peft_export.resolve() / "base")


def test_the_run_s_card_says_to_export_it_with_its_base(loftq_run, lora_run):
    card = (loftq_run / "README.md").read_text()
    assert "--format peft" in card and "PeftModel.from_pretrained(base" not in card
    assert "PeftModel.from_pretrained(base" in (lora_run / "README.md").read_text()


def test_the_adapter_alone_is_refused_for_a_loftq_iterated_run(loftq_run, tmp_path):
    done = mudpuppy("convert-adapter", loftq_run, tmp_path / "alone", "--to", "mlx")
    one_error(done, "loftq_iter 2", "--format peft", "--format merged")
    assert not (tmp_path / "alone").exists()
    steps = sorted((loftq_run / "checkpoints").glob("step-*"))
    assert steps, "the run keeps a checkpoint"
    one_error(mudpuppy("convert-adapter", steps[-1], tmp_path / "step", "--to", "peft"), "loftq_iter 2")
    one_error(mudpuppy("export", steps[-1], "--format", "peft", "--out", tmp_path / "export"), "loftq_iter 2")
    assert not (tmp_path / "step").exists() and not (tmp_path / "export").exists()


def test_bad_peft_exports_are_one_message(loftq_run, tiny_model_dir, lora_run, tmp_path):
    one_error(mudpuppy("export", tiny_model_dir, "--format", "peft", "--out", tmp_path / "a"),
              "--format peft writes an adapter", "--format merged")
    one_error(mudpuppy("export", loftq_run, "--format", "peft", "--quant", "q4", "--out", tmp_path / "b"),
              "--quant is for")
    one_error(mudpuppy("export", lora_run, "--format", "peft", "--dtype", "bf16", "--out", tmp_path / "c"),
              "--dtype", "writes no base")
    assert not any((tmp_path / name).exists() and any((tmp_path / name).iterdir()) for name in "abc")


def test_a_plain_adapter_exports_as_it_is(lora_run, peft_merged, tiny_model_dir, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "plain"
    done = mudpuppy("export", lora_run, "--format", "peft", "--out", out)
    assert done.exit_code == 0, done.output
    assert not (out / "base").exists()
    ours, run = (json.loads((d / "adapter_config.json").read_text()) for d in (out, lora_run))
    assert ours["base_model_name_or_path"] == run["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model, _ = peft_merged
    np.testing.assert_allclose(logits(PeftModel.from_pretrained(base, str(out)).eval(), IDS), logits(model, IDS),
                               atol=1e-5, rtol=0)


@pytest.mark.mlx
def test_mlx_lm_on_the_exported_base_is_mudpuppy_s_merged_model(peft_export, merged_logits):
    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")

    model, _ = mlx_lm.load(str(peft_export / "base"), adapter_path=str(peft_export / "mlx"))
    out = np.array(model(mx.array([IDS])).astype(mx.float32))[0]
    np.testing.assert_allclose(out, merged_logits, atol=1e-4, rtol=0)


@pytest.mark.mlx
def test_an_mlx_run_s_base_is_the_one_mlx_s_iterations_left(tmp_path):
    """On MLX the iterations requantize with MLX's own 4-bit format: the exports (peft and merged) rebuild the
    base on MLX, as `mudpuppy merge` of the run does, not with torch's quantizer."""
    pytest.importorskip("mlx.core")
    import torch
    import yaml
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ..conftest import build_tiny_model, tiny_run_config

    cfg = tiny_run_config(build_tiny_model(tmp_path / "wide", hidden_size=64), tmp_path / "run")
    cfg.update(backend="mlx", adapter=LOFTQ, eval={"before_training": False, "after_training": False})
    cfg["training"].update(max_steps=1, learning_rate=5e-2)
    cfg["data"].update(cache=False)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    for args in (("run", "-c", tmp_path / "run.yaml"), ("merge", tmp_path / "run", "--dtype", "float32"),
                 ("export", tmp_path / "run", "--format", "peft", "--out", tmp_path / "peft"),
                 ("export", tmp_path / "run", "--format", "merged", "--dtype", "fp32", "--out", tmp_path / "m"),
                 ("export", tmp_path / "run", "--format", "gguf", "--quant", "f32", "--no-eval", "--out", tmp_path / "g")):
        done = mudpuppy(*args)
        assert done.exit_code == 0, done.output
    assert json.loads((tmp_path / "peft" / "export.json").read_text())["peft"]["rebuilt_by"] == "mlx"
    merged = logits(AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "merged"), dtype=torch.float32), IDS)
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "peft" / "base"), dtype=torch.float32)
    ours = logits(PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval(), IDS)
    np.testing.assert_allclose(ours, merged, atol=1e-4, rtol=0)
    # `export --format merged` rebuilds that base on MLX too (torch's quantizer would give another model)
    exported = logits(AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32), IDS)
    np.testing.assert_allclose(exported, merged, atol=1e-4, rtol=0)
    from gguf import GGUFReader
    from safetensors.numpy import load_file

    down = load_file(str(tmp_path / "run" / "merged" / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    tensors = {t.name: t for t in GGUFReader(str(tmp_path / "g" / "model-f32.gguf")).tensors}
    np.testing.assert_allclose(np.asarray(tensors["blk.0.ffn_down.weight"].data), down, atol=1e-6, rtol=0)


def test_the_base_is_written_in_the_checkpoint_s_dtype_or_dtype(peft_export, loftq_run, tmp_path):
    from types import SimpleNamespace

    from safetensors import safe_open

    from mudpuppy.export.peft import checkpoint_dtype

    for config, expected in (({"dtype": "bfloat16"}, "bfloat16"), ({"torch_dtype": "float16"}, "float16"),
                             ({"dtype": "float8_e4m3fn"}, "float32"), ({}, "float32")):
        assert checkpoint_dtype(SimpleNamespace(model_config=lambda c=config: c)) == expected
    with safe_open(str(peft_export / "base" / "model.safetensors"), "np") as f:
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "F32"
    done = mudpuppy("export", loftq_run, "--format", "peft", "--dtype", "bf16", "--out", tmp_path / "bf16")
    assert done.exit_code == 0, done.output
    with safe_open(str(tmp_path / "bf16" / "base" / "model.safetensors"), "pt") as f:
        assert str(f.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype()) == "BF16"
    assert json.loads((tmp_path / "bf16" / "export.json").read_text())["peft"]["dtype"] == "bfloat16"


def test_no_room_for_the_base_is_refused_before_it_is_built(loftq_run, tmp_path, monkeypatch):
    import shutil

    import mudpuppy.export.peft as peft_export_module

    monkeypatch.setattr(peft_export_module.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    one_error(mudpuppy("export", loftq_run, "--format", "peft", "--out", tmp_path / "full"),
              "whole model", "GB free", "--out on another disk")
    assert not (tmp_path / "full").exists()
