"""The MLX backend end to end: the CLI run, what it saves, exact resume, QLoRA, and clear refusals."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

mx = pytest.importorskip("mlx.core")

from mudpuppy import load_config
from mudpuppy.backends import adapters as fmt
from mudpuppy.cli import main
from mudpuppy.errors import MudpuppyError

from .conftest import model_cfg, random_batch, training_batches

pytestmark = pytest.mark.mlx


def write_cfg(tmp_path, cfg):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_cli_run_on_mlx_writes_an_adapter_torch_and_mlx_lm_load(tiny_config, tiny_model_dir, mlx_backend, tmp_path):
    import torch
    from mlx_lm.utils import load_adapters
    from mlx_lm.utils import load_model as mlx_lm_load
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tiny_config["adapter"]["type"] = "dora"
    res = CliRunner().invoke(main, ["run", "--backend", "mlx", "--config", str(write_cfg(tmp_path, tiny_config))])
    assert res.exit_code == 0, res.output
    assert "backend: mlx on" in res.output and "held-out loss" in res.output
    out = tmp_path / "run"
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "metrics.jsonl",
                 "run_summary.json", "mlx/adapters.safetensors", "mlx/adapter_config.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "run_summary.json").read_text())["steps"] == 6

    mh = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    mlx_backend.load_adapter(mh, str(out))
    batch = random_batch(len(mh.tokenizer))
    ours = mlx_backend.logits(mh, batch)

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=torch.as_tensor(batch.input_ids),
                            attention_mask=torch.as_tensor(batch.attention_mask)).logits.numpy()
    assert np.abs(ours - theirs).max() < 1e-4
    # The trained adapter moved the model: this is not a comparison of two base models.
    untrained = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    assert np.abs(ours - mlx_backend.logits(untrained, batch)).max() > 1e-3

    model, _ = mlx_lm_load(tiny_model_dir)
    load_adapters(model, str(out / fmt.MLX_SUBDIR))
    assert np.abs(np.array(model(mx.array(batch.input_ids[:1]))) - ours[:1]).max() < 1e-4


def test_torch_backend_loads_and_evaluates_an_mlx_trained_adapter(mlx_config, tiny_model_dir, torch_backend,
                                                                 mlx_backend):
    from mudpuppy import run

    result = run(load_config(mlx_config), mlx_backend, echo=lambda *_: None)
    th = torch_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    torch_backend.load_adapter(th, str(result.output_dir))
    batch = random_batch(len(th.tokenizer))
    assert np.abs(torch_backend.logits(th, batch) - mlx_backend.logits(result.model, batch)).max() < 1e-4
    mlx_loss, torch_loss = mlx_backend.evaluate_loss(result.model, [batch]), torch_backend.evaluate_loss(th, [batch])
    assert mlx_loss[1] == torch_loss[1] and mlx_loss[0] == pytest.approx(torch_loss[0], rel=1e-5)


def test_resume_continues_exactly(tiny_config, mlx_backend, tmp_path):
    """4 steps straight == 2 steps, save adapter + trainer state, fresh process state, 2 more (dropout on)."""
    tiny_config["adapter"].update(type="lora", dropout=0.1)
    cfg = load_config(tiny_config)

    def fresh():
        mlx_backend.seed(cfg.training.seed)
        handle = mlx_backend.load_model(cfg.model, "fp32")
        mlx_backend.attach_adapter(handle, cfg.adapter)
        return handle, mlx_backend.create_trainer(handle, cfg.training)

    handle, trainer = fresh()
    batches = training_batches(cfg, handle.tokenizer, steps=4, accumulation=1)
    straight = [trainer.step(b, 1e-2).loss for b in batches]

    handle, trainer = fresh()
    first = [trainer.step(b, 1e-2).loss for b in batches[:2]]
    mlx_backend.save_adapter(handle, str(tmp_path / "ckpt"))
    state = trainer.state_dict()
    assert all(isinstance(v, np.ndarray) for v in state["optimizer"].values())

    mx.random.seed(12345)  # whatever happened in between must not matter
    resumed = mlx_backend.load_model(cfg.model, "fp32")
    mlx_backend.load_adapter(resumed, str(tmp_path / "ckpt"), trainable=True)
    trainer = mlx_backend.create_trainer(resumed, cfg.training)
    trainer.load_state_dict(state)
    second = [trainer.step(b, 1e-2).loss for b in batches[2:]]
    assert first + second == straight


def test_a_released_trainer_drops_its_optimizer_state_and_mlxs_cache(tiny_config, mlx_backend, monkeypatch):
    """After the run's last checkpoint the Adam moments go and MLX's buffer cache is emptied (issue 28 item 6)."""
    cfg = load_config(tiny_config)
    handle = mlx_backend.load_model(cfg.model, "fp32")
    mlx_backend.attach_adapter(handle, cfg.adapter)
    trainer = mlx_backend.create_trainer(handle, cfg.training)
    trainer.step(training_batches(cfg, handle.tokenizer, steps=1, accumulation=1)[0], 1e-2)
    assert trainer.state_dict()["optimizer"]
    cleared = []
    monkeypatch.setattr(mx, "clear_cache", lambda: cleared.append(True))
    trainer.release()
    assert trainer.optimizer is None and cleared == [True]


@pytest.mark.parametrize("quant_backend, mode", [("int4", "affine"), ("mxfp4", "mxfp4")])
def test_qlora_trains_lora_on_a_4bit_base(wide_model_dir, mlx_backend, tiny_config, tmp_path, quant_backend, mode):
    from mlx import nn

    tiny_config["model"]["base_model"] = str(wide_model_dir)
    cfg = load_config(tiny_config)
    handle = mlx_backend.load_model(cfg.model, "fp32")
    plain = mlx_backend.logits(handle, random_batch(len(handle.tokenizer)))
    adapter_cfg = SimpleNamespace(type="qlora", quant_backend=quant_backend, r=4, alpha=8, dropout=0.0,
                                  target_modules="all-linear", rslora=False)
    info = mlx_backend.attach_adapter(handle, adapter_cfg)
    quantized = [m for _, m in handle.model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert len(quantized) == 14 and all(q.mode == mode and q.bits == 4 for q in quantized)
    assert info.trainable_params == sum(v.size for k, v in _flat(handle.model.trainable_parameters()))
    assert all(k.rsplit(".", 1)[-1] in ("lora_a", "lora_b") for k, _ in _flat(handle.model.trainable_parameters()))
    # A 4-bit base is close to the original (B = 0 at the start), not equal to it.
    close = mlx_backend.logits(handle, random_batch(len(handle.tokenizer)))
    relative = np.linalg.norm(close - plain) / np.linalg.norm(plain)
    assert 0 < relative < 0.6, relative  # 4 bits on random weights: ~0.35 measured
    trainer = mlx_backend.create_trainer(handle, cfg.training)
    losses = [trainer.step(b, 2e-2).loss for b in training_batches(cfg, handle.tokenizer, 6, 1)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    mlx_backend.save_adapter(handle, str(tmp_path / "qlora"))
    saved = json.loads((tmp_path / "qlora" / "mlx" / "adapter_config.json").read_text())
    assert saved["mudpuppy"]["quantization"]["quant_backend"] == quant_backend
    assert fmt.read_adapter(tmp_path / "qlora").r == 4


def test_unknown_quant_format_is_refused(wide_model_dir, mlx_backend):
    handle = mlx_backend.load_model(model_cfg(wide_model_dir), "fp32")
    bad = SimpleNamespace(type="qlora", quant_backend="nf4", r=4, alpha=8, dropout=0.0,
                          target_modules="all-linear", rslora=False)
    with pytest.raises(MudpuppyError, match="quant_backend 'nf4' is not available on MLX; choose one of: int4, mxfp4"):
        mlx_backend.attach_adapter(handle, bad)


def test_bf16_base_trains_close_to_fp32(tiny_config, mlx_backend):
    cfg = load_config(tiny_config)
    losses = {}
    for precision in ("fp32", "bf16"):
        mlx_backend.seed(cfg.training.seed)
        handle = mlx_backend.load_model(cfg.model, precision)
        mlx_backend.attach_adapter(handle, cfg.adapter)
        trainer = mlx_backend.create_trainer(handle, cfg.training)
        losses[precision] = [trainer.step(b, 5e-3).loss for b in training_batches(cfg, handle.tokenizer, 3, 1)]
        layer = handle.model.layers[0].self_attn.q_proj
        expected = mx.bfloat16 if precision == "bf16" else mx.float32
        assert layer.linear.weight.dtype == expected and layer.lora_a.dtype == mx.float32
    assert np.allclose(losses["bf16"], losses["fp32"], atol=0.05)


def test_full_fine_tune_saves_a_model_transformers_loads(tiny_config, tiny_model_dir, mlx_backend, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    tiny_config["adapter"] = {"type": "none"}
    tiny_config["training"]["learning_rate"] = 1e-3
    cfg = load_config(tiny_config)
    handle = mlx_backend.load_model(cfg.model, "fp32")
    mlx_backend.attach_adapter(handle, cfg.adapter)
    trainer = mlx_backend.create_trainer(handle, cfg.training)
    for micro in training_batches(cfg, handle.tokenizer, 2, 1):
        trainer.step(micro, 1e-3)
    mlx_backend.save_model(handle, str(tmp_path / "full"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "full"), dtype=torch.float32).eval()
    batch = random_batch(len(handle.tokenizer))
    with torch.no_grad():
        theirs = reloaded(input_ids=torch.as_tensor(batch.input_ids),
                          attention_mask=torch.as_tensor(batch.attention_mask)).logits.numpy()
    assert np.abs(mlx_backend.logits(handle, batch) - theirs).max() < 1e-4


@pytest.mark.parametrize("change, message", [
    ({"training": {"gradient_checkpointing": True}}, "training.gradient_checkpointing is not available on the MLX"),
    ({"training": {"precision": "bf16"}, "adapter": {"type": "none"}}, "bf16 with adapter.type none"),
    ({"adapter": {"target_modules": ["qkv"]}}, "adapter.target_modules: qkv match no linear layer"),
])
def test_options_mlx_cannot_do_are_refused_by_name(mlx_config, tmp_path, change, message):
    for section, values in change.items():
        mlx_config[section].update(values)
    res = CliRunner().invoke(main, ["run", "--config", str(write_cfg(tmp_path, mlx_config))])
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output
    assert "backend: mlx" in res.output  # refused on MLX, not quietly moved to torch


def test_packing_without_mask_support_is_refused(tiny_model_dir, mlx_backend, tiny_config):
    from mudpuppy.data import collate_packed, prepare_sft_data

    handle = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    examples = prepare_sft_data(load_config(tiny_config), handle.tokenizer).train[:2]
    packed = collate_packed([examples], handle.tokenizer.pad_token_id)
    assert handle.packable  # Llama: masks and rotary positions
    handle.masks = handle.packable = False  # as for an architecture that ignores the mask hook
    with pytest.raises(MudpuppyError, match="does not accept an attention mask.* set data.packing: false"):
        mlx_backend.evaluate_loss(handle, [packed])
    handle.masks = True  # as for learned absolute positions (GPT-2)
    with pytest.raises(MudpuppyError, match="has no rotary embeddings"):
        mlx_backend.evaluate_loss(handle, [packed])


def test_an_adapter_for_another_model_is_refused(tiny_model_dir, wide_model_dir, mlx_backend, tmp_path):
    from .conftest import make_peft_adapter

    make_peft_adapter(tiny_model_dir, tmp_path / "narrow")
    handle = mlx_backend.load_model(model_cfg(wide_model_dir), "fp32")
    expected = r"down_proj is \[64 x 128\] in this model but the adapter expects \[32 x 64\]"
    with pytest.raises(MudpuppyError, match=expected):
        mlx_backend.load_adapter(handle, str(tmp_path / "narrow"))


def test_backends_command_reports_mlx_and_its_device():
    res = CliRunner().invoke(main, ["backends"])
    assert res.exit_code == 0
    line = next(l for l in res.output.splitlines() if l.startswith("mlx"))
    assert "available" in line and ("Metal GPU" in line or "CPU only" in line)


def _flat(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_merged_model_loads_in_transformers_with_the_adapter_logits(tiny_config, mlx_backend, tmp_path, kind):
    import torch
    from transformers import AutoModelForCausalLM

    tiny_config["adapter"]["type"] = kind
    cfg = load_config(tiny_config)
    handle = mlx_backend.load_model(cfg.model, "fp32")
    mlx_backend.attach_adapter(handle, cfg.adapter)
    trainer = mlx_backend.create_trainer(handle, cfg.training)
    for micro in training_batches(cfg, handle.tokenizer, 3, 1):
        trainer.step(micro, 2e-2)
    batch = random_batch(len(handle.tokenizer))
    adapted = mlx_backend.logits(handle, batch)
    mlx_backend.merge_and_save(handle, str(tmp_path / "merged"), "float32")
    assert np.abs(mlx_backend.logits(handle, batch) - adapted).max() < 1e-4
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = merged(input_ids=torch.as_tensor(batch.input_ids),
                        attention_mask=torch.as_tensor(batch.attention_mask)).logits.numpy()
    assert np.abs(theirs - adapted).max() < 1e-4
    before = (tmp_path / "merged" / "model.safetensors").read_bytes()
    mlx_backend.merge_and_save(handle, str(tmp_path / "merged"), "float32")  # nothing left to merge
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == before


def test_sigkill_then_resume_on_mlx_matches_an_uninterrupted_run(tiny_config, tmp_path):
    """The shared checkpoint machinery (training/checkpoints.py) with MLX's training state."""
    import os
    import signal
    import subprocess
    import sys

    from ...faults import kill_after
    from safetensors.numpy import load_file

    def config(out):
        cfg = dict(tiny_config, output_dir=str(out), backend="mlx")
        cfg["adapter"] = {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.1}  # the RNG must resume too
        cfg["training"] = dict(tiny_config["training"], max_steps=6, save_steps=3, warmup_steps=2)
        cfg["eval"] = {"before_training": False, "after_training": False}
        path = tmp_path / f"{out.name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def cli(path, *extra, env=None):
        return subprocess.run([sys.executable, "-m", "mudpuppy.cli", "run", "-c", str(path), *extra], check=False,
                              capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300)

    straight, broken = config(tmp_path / "straight"), config(tmp_path / "broken")
    assert cli(straight).returncode == 0
    killed = cli(broken, env=kill_after(3))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = cli(broken, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    rows = {name: [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("straight", "broken")}
    assert [r["loss"] for r in rows["broken"]] == [r["loss"] for r in rows["straight"]]
    a = load_file(str(tmp_path / "straight" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "broken" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
