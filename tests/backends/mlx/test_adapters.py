"""PEFT <-> mlx-lm adapter conversion: lossless, and clear about what it cannot convert.

Pure format tests: no MLX needed (the conversion is numpy and json).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from mudpuppy.backends import adapters as fmt
from mudpuppy.cli import main

from .conftest import make_peft_adapter


@pytest.fixture(scope="module")
def peft_dora_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("peft-dora")
    make_peft_adapter(tiny_model_dir, out, dora=True, rslora=True)
    return out


def test_peft_to_mlx_to_peft_is_lossless(peft_dora_dir, tmp_path):
    fmt.convert_adapter(peft_dora_dir, tmp_path / "mlx", "mlx")
    fmt.convert_adapter(tmp_path / "mlx", tmp_path / "back", "peft")
    before, _ = fmt.read_safetensors(peft_dora_dir / fmt.PEFT_WEIGHTS)
    after, _ = fmt.read_safetensors(tmp_path / "back" / fmt.PEFT_WEIGHTS)
    assert before.keys() == after.keys()
    assert all(before[k].equals(after[k]) for k in before)
    original = json.loads((peft_dora_dir / fmt.CONFIG_FILE).read_text())
    assert json.loads((tmp_path / "back" / fmt.CONFIG_FILE).read_text()) == original


def test_mlx_layout_is_transposed_renamed_and_scaled(peft_dora_dir, tmp_path):
    fmt.convert_adapter(peft_dora_dir, tmp_path / "mlx", "mlx")
    peft, _ = fmt.read_safetensors(peft_dora_dir / fmt.PEFT_WEIGHTS)
    mlx, meta = fmt.read_safetensors(tmp_path / "mlx" / fmt.MLX_WEIGHTS)
    path = "model.layers.1.self_attn.q_proj"
    a = peft[f"base_model.model.{path}.lora_A.weight"].array
    assert a.shape == (4, 32)
    assert np.array_equal(mlx[f"{path}.lora_a"].array, a.T)
    assert np.array_equal(mlx[f"{path}.lora_b"].array, peft[f"base_model.model.{path}.lora_B.weight"].array.T)
    assert np.array_equal(mlx[f"{path}.m"].array, peft[f"base_model.model.{path}.lora_magnitude_vector"].array)
    config = json.loads((tmp_path / "mlx" / fmt.CONFIG_FILE).read_text())
    assert config["fine_tune_type"] == "dora" and config["num_layers"] == -1
    assert config["lora_parameters"]["rank"] == 4
    assert config["lora_parameters"]["scale"] == pytest.approx(6 / 2.0)  # rsLoRA: alpha / sqrt(r)
    assert config["lora_parameters"]["keys"] == ["mlp.down_proj", "self_attn.q_proj", "self_attn.v_proj"]
    assert meta == {"format": "mlx"}


def test_bf16_adapters_convert_bit_for_bit(tmp_path):
    import torch
    from safetensors.torch import load_file

    rng = np.random.default_rng(0)
    bits = lambda *shape: fmt.RawTensor("BF16", rng.integers(0, 0x7F00, shape, dtype=np.uint16))
    src = tmp_path / "src"
    src.mkdir()
    p = "base_model.model.model.layers.0.mlp.up_proj"
    fmt.write_safetensors(src / fmt.PEFT_WEIGHTS, {f"{p}.lora_A.weight": bits(2, 8), f"{p}.lora_B.weight": bits(16, 2)},
                          {"format": "pt"})
    (src / fmt.CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                   "target_modules": ["up_proj"]}))
    fmt.convert_adapter(src, tmp_path / "mlx", "mlx")
    fmt.convert_adapter(tmp_path / "mlx", tmp_path / "back", "peft")
    original = load_file(str(src / fmt.PEFT_WEIGHTS))
    back = load_file(str(tmp_path / "back" / fmt.PEFT_WEIGHTS))
    assert original[f"{p}.lora_A.weight"].dtype == torch.bfloat16
    assert all(torch.equal(original[k], back[k]) for k in original)
    as_mlx = load_file(str(tmp_path / "mlx" / fmt.MLX_WEIGHTS))
    assert torch.equal(as_mlx["model.layers.0.mlp.up_proj.lora_a"], original[f"{p}.lora_A.weight"].T)


def test_an_adapter_written_by_mlx_lm_gets_a_peft_config(tmp_path):
    src = tmp_path / "mlx-lm"
    src.mkdir()
    rng = np.random.default_rng(0)
    f32 = lambda *shape: fmt.RawTensor("F32", rng.normal(size=shape).astype(np.float32))
    fmt.write_safetensors(src / fmt.MLX_WEIGHTS, {
        "model.layers.1.self_attn.q_proj.lora_a": f32(32, 8), "model.layers.1.self_attn.q_proj.lora_b": f32(8, 32),
    }, {"format": "mlx"})
    (src / fmt.CONFIG_FILE).write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": 1, "model": "some/model",
        "lora_parameters": {"rank": 8, "scale": 20.0, "dropout": 0.0, "keys": ["self_attn.q_proj"]}}))
    fmt.convert_adapter(src, tmp_path / "peft", "peft")
    config = json.loads((tmp_path / "peft" / fmt.CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 160
    assert config["target_modules"] == ["self_attn.q_proj"] and config["layers_to_transform"] == [1]
    assert config["base_model_name_or_path"] == "some/model" and config["use_dora"] is False


@pytest.mark.parametrize("change, message", [
    ({"rank_pattern": {"q_proj": 8}}, "per-module ranks"),
    ({"modules_to_save": ["lm_head"]}, "fully trained extra modules"),
    ({"peft_type": "IA3"}, "only LoRA"),
    ({"use_dora": False}, "DoRA magnitude but the config does not say use_dora"),
])
def test_unconvertible_peft_adapters_are_refused_by_name(peft_dora_dir, tmp_path, change, message):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / fmt.PEFT_WEIGHTS).write_bytes((peft_dora_dir / fmt.PEFT_WEIGHTS).read_bytes())
    config = json.loads((peft_dora_dir / fmt.CONFIG_FILE).read_text())
    (bad / fmt.CONFIG_FILE).write_text(json.dumps({**config, **change}))
    with pytest.raises(fmt.AdapterError, match=message):
        fmt.convert_adapter(bad, tmp_path / "out", "mlx")
    assert not (tmp_path / "out").exists()


def test_cli_converts_both_ways(peft_dora_dir, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["convert-adapter", str(peft_dora_dir), str(tmp_path / "m"), "--to", "mlx"])
    assert res.exit_code == 0, res.output
    assert "dora, r=4" in res.output and (tmp_path / "m" / fmt.MLX_WEIGHTS).is_file()
    res = runner.invoke(main, ["convert-adapter", str(tmp_path / "m"), str(tmp_path / "p"), "--to", "peft"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "p" / fmt.PEFT_WEIGHTS).is_file()


def test_cli_refuses_what_is_not_an_adapter(tiny_model_dir, peft_dora_dir, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["convert-adapter", str(tiny_model_dir), str(tmp_path / "x"), "--to", "mlx"])
    assert res.exit_code == 2
    assert "is not an adapter directory" in res.output and "looks like a full model" in res.output
    res = runner.invoke(main, ["convert-adapter", str(tmp_path / "missing"), str(tmp_path / "x"), "--to", "peft"])
    assert res.exit_code == 2 and "no such directory" in res.output
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("keep me")
    res = runner.invoke(main, ["convert-adapter", str(peft_dora_dir), str(tmp_path / "taken"), "--to", "mlx"])
    assert res.exit_code == 2 and "not an empty directory" in res.output
    assert (tmp_path / "taken" / "notes.txt").read_text() == "keep me"
    res = runner.invoke(main, ["convert-adapter", str(peft_dora_dir), str(tmp_path / "y"), "--to", "gguf"])
    assert res.exit_code == 2 and "gguf" in res.output


def test_missing_mlx_is_one_message_with_the_install_command(monkeypatch, tiny_config, tmp_path):
    import sys

    import yaml
    from mudpuppy.backends import factory

    for name in ("mlx", "mlx.core"):
        monkeypatch.setitem(sys.modules, name, None)  # import mlx.core now raises ImportError
    result = factory.probe("mlx")
    assert not result.available and "pip install" in result.reason and "mlx-lm" in result.reason
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_config))
    res = CliRunner().invoke(main, ["run", "--backend", "mlx", "--config", str(path)])
    assert res.exit_code == 2
    assert res.output.startswith("error: mlx: mlx is not installed") and "pip install" in res.output
    assert "Traceback" not in res.output
