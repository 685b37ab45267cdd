"""MLX export: mlx-lm loads the directory mlx_lm.convert wrote and computes the PEFT merge's logits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mudpuppy.export import ExportRequest, export_model

from .conftest import logits

pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.mlx


def mlx_logits(out, ids):
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(out))
    return np.array(model(mx.array([ids]))[0].astype(mx.float32)), tokenizer


@pytest.fixture(scope="module")
def prompt(peft_merged):
    _, tok = peft_merged
    messages = [{"role": "user", "content": "dim the living room lights"}]
    return tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


def test_an_fp32_mlx_export_of_a_run_matches_torch(lora_run, peft_merged, prompt, tmp_path):
    model, tok = peft_merged
    out = tmp_path / "mlx"
    export_model(ExportRequest(str(lora_run), "mlx", str(out), dtype="fp32"), echo=lambda *_a, **_k: None)
    got, mlx_tok = mlx_logits(out, prompt)
    assert np.abs(got - logits(model, prompt)).max() < 1e-3
    assert mlx_tok.chat_template == tok.chat_template          # the training template travels along
    # mudpuppy's card, not mlx_lm.convert's front matter alone (which names the scratch merge as the base)
    card = (out / "README.md").read_text()
    assert "library_name: mlx" in card and "## Base model" in card and "## What was trained" in card
    assert f'load("{out.name}")' in card and "mlx_lm.generate" in card and ".work-" not in card
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert "quantization" not in config


def test_a_q8_mlx_export_is_quantized_by_mlx_lm(lora_run, peft_merged, prompt, tmp_path):
    model, _ = peft_merged
    out = tmp_path / "mlx-q8"
    export_model(ExportRequest(str(lora_run), "mlx", str(out), dtype="fp32", quant="q8"), echo=lambda *_a, **_k: None)
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 8
    got, _ = mlx_logits(out, prompt)
    # mlx-lm quantizes the matrices whose rows fill its 64-wide groups (the tiny model's down
    # projections): a small, visible change
    diff = np.abs(got - logits(model, prompt)).max()
    assert 1e-5 < diff < 0.1
