"""adapter.init on MLX: the same starting A, B and residual base as torch's PEFT, the base function kept
at step 0, and a trained PiSSA / OLoRA adapter saved as a plain LoRA that plain PEFT reads on the original
base with the same logits."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mudpuppy.config import AdapterConfig

from .conftest import model_cfg, random_batch

pytestmark = pytest.mark.mlx


def both_attached(model_dir, torch_backend, mlx_backend, init, rslora=False):
    cfg = AdapterConfig(type="lora", r=4, alpha=8, init=init, rslora=rslora)
    th = torch_backend.load_model(model_cfg(model_dir), "fp32")
    torch_backend.attach_adapter(th, cfg)
    mh = mlx_backend.load_model(model_cfg(model_dir), "fp32")
    mlx_backend.attach_adapter(mh, cfg)
    return th, mh


@pytest.mark.parametrize("init,rslora", [("pissa", False), ("olora", False), ("pissa", True)])
def test_mlx_starts_from_torch_s_factors_and_residual(tiny_model_dir, torch_backend, mlx_backend, init, rslora):
    from mudpuppy.backends.mlx.layers import adapter_layers

    th, mh = both_attached(tiny_model_dir, torch_backend, mlx_backend, init, rslora)
    torch_layers = {name: layer for name, layer in th.model.base_model.model.named_modules()
                    if hasattr(layer, "lora_A")}
    mlx_layers = adapter_layers(mh.model)
    assert set(mlx_layers) == set(torch_layers) and len(mlx_layers) == 14
    for path, layer in mlx_layers.items():
        theirs = torch_layers[path]
        np.testing.assert_allclose(np.array(layer.lora_a.T), theirs.lora_A["default"].weight.detach().numpy(),
                                   atol=1e-5)
        np.testing.assert_allclose(np.array(layer.lora_b.T), theirs.lora_B["default"].weight.detach().numpy(),
                                   atol=1e-5)
        np.testing.assert_allclose(np.array(layer.linear.weight), theirs.base_layer.weight.detach().numpy(),
                                   atol=1e-5)
    batch = random_batch(len(mh.tokenizer))
    untouched = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    np.testing.assert_allclose(mlx_backend.logits(mh, batch), mlx_backend.logits(untouched, batch), atol=1e-5)


@pytest.mark.parametrize("init,rslora", [("pissa", False), ("olora", False), ("pissa", True)])
def test_trained_mlx_adapter_reloads_in_plain_peft_on_the_original_base(tiny_model_dir, mlx_backend, tmp_path, init,
                                                                          rslora):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mudpuppy.backends.mlx.layers import adapter_layers

    mh = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    mlx_backend.attach_adapter(mh, AdapterConfig(type="lora", r=4, alpha=8, init=init, rslora=rslora))
    rng = np.random.default_rng(0)
    for layer in adapter_layers(mh.model).values():   # a stand-in for training: both factors move
        layer.lora_a = layer.lora_a + mx.array(rng.normal(0, 0.05, layer.lora_a.shape).astype(np.float32))
        layer.lora_b = layer.lora_b + mx.array(rng.normal(0, 0.05, layer.lora_b.shape).astype(np.float32))
    batch = random_batch(len(mh.tokenizer))
    ours = mlx_backend.logits(mh, batch)
    mlx_backend.save_adapter(mh, str(tmp_path / "adapter"))

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        before = base(input_ids=torch.as_tensor(batch.input_ids)).logits.numpy()
        plain = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        theirs = plain(input_ids=torch.as_tensor(batch.input_ids),
                       attention_mask=torch.as_tensor(batch.attention_mask)).logits.numpy()
    assert plain.peft_config["default"].r == 8 and plain.peft_config["default"].use_rslora == rslora
    assert np.abs(theirs - before).max() > 1e-2, "the adapter moved the model"
    np.testing.assert_allclose(theirs, ours, atol=1e-4)
    # mlx-lm's copy beside it loads on the original base too, through mudpuppy's MLX reader.
    again = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    mlx_backend.load_adapter(again, str(tmp_path / "adapter" / "mlx"))
    np.testing.assert_allclose(mlx_backend.logits(again, batch), ours, atol=1e-5)


def test_gaussian_a_has_peft_s_spread(tiny_model_dir, mlx_backend):
    from mudpuppy.backends.mlx.layers import adapter_layers

    mh = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    mlx_backend.attach_adapter(mh, AdapterConfig(type="lora", r=4, alpha=8, init="gaussian"))
    a = np.concatenate([np.array(layer.lora_a).ravel() for layer in adapter_layers(mh.model).values()])
    assert abs(a.std() - 1 / 4) < 0.02 and abs(a.mean()) < 0.02
    assert all(not np.array(layer.lora_b).any() for layer in adapter_layers(mh.model).values())
