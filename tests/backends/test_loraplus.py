"""LoRA+ (training.loraplus_lr_ratio): torch's parameter groups are PEFT's create_loraplus_optimizer's, torch
and MLX take the same steps, and a run resumes exactly (on its runtime and across runtimes)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mudpuppy import create_backend, load_config, run
from mudpuppy.config import AdapterConfig, ModelConfig, TrainingConfig
from mudpuppy.training.loop import Interrupted

from ..faults import StopAfter

RATIO = 16.0


def attached(model_dir, kind: str):
    backend = create_backend("cpu")
    handle = backend.load_model(ModelConfig(base_model=str(model_dir)), "fp32")
    backend.attach_adapter(handle, AdapterConfig(type=kind, r=4, alpha=8))
    return backend, handle


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_torch_groups_are_peft_s_loraplus_groups(tiny_model_dir, kind):
    from peft.optimizers import create_loraplus_optimizer

    backend, handle = attached(tiny_model_dir, kind)
    cfg = TrainingConfig(learning_rate=2e-4, weight_decay=0.01, loraplus_lr_ratio=RATIO)
    trainer = backend.create_trainer(handle, cfg)
    for group in trainer.optimizer.param_groups:       # what the trainer does before each step
        group["lr"] = cfg.learning_rate * group["lr_ratio"]
    theirs = create_loraplus_optimizer(handle.model, torch.optim.AdamW, lr=2e-4, loraplus_lr_ratio=RATIO,
                                       loraplus_weight_decay=0.01)
    ours = trainer.optimizer.param_groups
    assert len(ours) == len(theirs.param_groups) == 4
    for mine, peft_group in zip(ours, theirs.param_groups):
        assert [id(p) for p in mine["params"]] == [id(p) for p in peft_group["params"]]
        assert mine["lr"] == pytest.approx(peft_group["lr"], rel=1e-12)
        assert mine["weight_decay"] == peft_group["weight_decay"]
    fast = {id(p) for p in ours[2]["params"]}
    names = {n for n, p in handle.model.named_parameters() if id(p) in fast}
    assert names and all("lora_B" in n or "magnitude" in n for n in names)
    assert any("magnitude" in n for n in names) == (kind == "dora")
    assert ours[0]["params"] and ours[2]["params"]


def test_loraplus_with_optimizer_offload_keeps_the_groups(tiny_model_dir):
    """The host masters step in the same groups (the inner optimizer gets each group's rate)."""
    from mudpuppy.backends.torch.handle import DevicePlan
    from mudpuppy.backends.torch.optimizers import HostOffloadOptimizer, build_optimizer
    from mudpuppy.config import MemoryConfig

    backend, handle = attached(tiny_model_dir, "lora")
    params = [p for p in handle.model.parameters() if p.requires_grad]
    cfg = TrainingConfig(learning_rate=1e-3, loraplus_lr_ratio=RATIO)
    plan = DevicePlan("cpu", torch.device("cpu"), memory=MemoryConfig(optimizer_offload=True))
    optimizer = build_optimizer(params, cfg, plan, handle.model)
    assert isinstance(optimizer, HostOffloadOptimizer)
    assert [g["lr_ratio"] for g in optimizer.inner.param_groups] == [1.0, 1e-6 / 1e-3, RATIO, RATIO]
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(params)


def test_loraplus_needs_an_adapter_in_the_config(tiny_config):
    tiny_config["adapter"] = {"type": "none"}
    tiny_config["training"]["loraplus_lr_ratio"] = RATIO
    with pytest.raises(Exception, match=r"training\.loraplus_lr_ratio: .*adapter\.type none"):
        load_config(tiny_config)
    tiny_config["adapter"] = {"type": "dora"}
    assert load_config(tiny_config).training.loraplus_lr_ratio == RATIO


def quiet(*_):
    pass


def loraplus_config(tiny_config, out, **adapter) -> dict:
    cfg = json.loads(json.dumps(tiny_config))
    cfg["output_dir"] = str(out)
    cfg["adapter"] = {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0, **adapter}
    cfg["training"].update({"max_steps": 6, "save_steps": 3, "micro_batch_size": 4, "warmup_steps": 1,
                            "precision": "fp32", "learning_rate": 2e-3, "weight_decay": 0.01,
                            "loraplus_lr_ratio": RATIO})
    cfg["eval"] = {"before_training": False, "after_training": False}
    return cfg


def straight_and_resumed(cfg: dict, first: str, second: str, tmp_path):
    straight = run(load_config({**cfg, "output_dir": str(tmp_path / "straight")}), create_backend(first), echo=quiet)
    moved = {**cfg, "output_dir": str(tmp_path / "moved")}
    with pytest.raises(Interrupted):
        run(load_config(moved), StopAfter(create_backend(first), 3), echo=quiet)
    resumed = run(load_config({**moved, "resume": True}), create_backend(second), echo=quiet)
    return straight, resumed


def adapters(tmp_path):
    from safetensors.numpy import load_file

    return [load_file(str(tmp_path / name / "adapter_model.safetensors")) for name in ("straight", "moved")]


def test_a_loraplus_run_resumes_bit_for_bit_on_torch(tiny_config, tmp_path):
    straight, resumed = straight_and_resumed(loraplus_config(tiny_config, tmp_path), "cpu", "cpu", tmp_path)
    assert resumed.resumed_from == 3 and resumed.losses == straight.losses
    a, b = adapters(tmp_path)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.mlx
@pytest.mark.parametrize("first,second", [("cpu", "mlx"), ("mlx", "cpu")])
def test_a_loraplus_run_moves_between_runtimes(first, second, tiny_config, tmp_path):
    """The portable state maps torch's group-ordered optimizer state to the parameters by name."""
    pytest.importorskip("mlx.core")
    straight, resumed = straight_and_resumed(loraplus_config(tiny_config, tmp_path), first, second, tmp_path)
    np.testing.assert_allclose(resumed.losses, straight.losses, atol=1e-4, rtol=0)
    a, b = adapters(tmp_path)
    for key in a:
        np.testing.assert_allclose(b[key], a[key], atol=1e-4, rtol=0, err_msg=key)


@pytest.mark.mlx
@pytest.mark.parametrize("adapter", [{"type": "lora", "r": 4, "alpha": 8},
                                     {"type": "dora", "r": 4, "alpha": 8, "target_modules": ["q_proj", "down_proj"]}],
                         ids=["lora", "dora"])
def test_torch_and_mlx_take_the_same_loraplus_steps(tiny_config, tmp_path, adapter):
    """Ten steps on both runtimes agree at the parity tolerance, and LoRA+ changed them (not a no-op)."""
    pytest.importorskip("mlx.core")
    from .mlx.test_parity import LOSS_TOL, _paired_run

    training = {"optimizer": "adamw", "learning_rate": 2e-3, "loraplus_lr_ratio": RATIO}
    torch_backend, mlx_backend = create_backend("cpu"), create_backend("mlx")
    rows = _paired_run(json.loads(json.dumps(tiny_config)), torch_backend, mlx_backend, tmp_path, adapter, training)
    worst = max(abs(t.loss - m.loss) for t, m in rows)
    assert worst < LOSS_TOL, [(t.loss, m.loss) for t, m in rows]
    plain = _paired_run(json.loads(json.dumps(tiny_config)), torch_backend, mlx_backend, tmp_path / "plain", adapter,
                        {"optimizer": "adamw", "learning_rate": 2e-3})
    assert max(abs(t.loss - p.loss) for (t, _), (p, _) in zip(rows, plain)) > 10 * LOSS_TOL
