"""adapter.init eva: PEFT's EVA (initialize_lora_eva_weights) on fixed batches gives the A matrices, ranks and
scales mudpuppy attaches (its one-rank LoRA padded with zero components), the trained adapter reloads in plain
PEFT with the same logits, and MLX starts from the same A."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mudpuppy import create_backend, load_config
from mudpuppy.backends.adapters.eva import eva_labels
from mudpuppy.config import AdapterConfig, ModelConfig

from .mlx.conftest import random_batch

RHO = 2.0


def fixed_batches(vocab: int) -> list:
    return [random_batch(vocab, rows=4, width=16, seed=seed) for seed in range(4)]


def peft_eva(model_dir, targets, batches, rho=RHO):
    """PEFT's own EVA on the plain checkpoint: {layer: (A [r_i, in], scaling)}, and the model."""
    from peft import EvaConfig, LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.eva import initialize_lora_eva_weights
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights="eva",
                                            eva_config=EvaConfig(rho=rho)))
    inputs = [{"input_ids": torch.as_tensor(b.input_ids), "attention_mask": torch.as_tensor(b.attention_mask),
               "labels": torch.as_tensor(eva_labels(b.labels))} for b in batches]
    initialize_lora_eva_weights(model, inputs, show_progress_bar=False,
                                forward_fn=lambda m, x: m(input_ids=x["input_ids"], attention_mask=x["attention_mask"]))
    layers = {name: layer for name, layer in model.get_base_model().named_modules()
              if isinstance(layer, LoraLayer) and "default" in layer.lora_A}
    return model, {name: (layer.lora_A["default"].weight.detach().numpy(), layer.scaling["default"])
                   for name, layer in layers.items()}


def ours(model_dir, batches, rho=RHO):
    backend = create_backend("cpu")
    handle = backend.load_model(ModelConfig(base_model=str(model_dir)), "fp32")
    backend.attach_adapter(handle, AdapterConfig(type="lora", r=4, alpha=8, init="eva", eva_rho=rho), batches=batches)
    return backend, handle


def lora_layers(handle):
    from peft.tuners.lora import LoraLayer

    return {name: layer for name, layer in handle.model.get_base_model().named_modules()
            if isinstance(layer, LoraLayer) and "default" in layer.lora_A}


@pytest.mark.parametrize("rho", [1.0, RHO])
def test_eva_starts_from_peft_s_components_ranks_and_scales(tiny_model_dir, rho):
    backend, handle = ours(tiny_model_dir, fixed_batches(320), rho)
    targets = sorted(handle.model.peft_config["default"].target_modules)
    theirs_model, theirs = peft_eva(tiny_model_dir, targets, fixed_batches(320), rho)
    mine = lora_layers(handle)
    assert set(theirs) <= set(mine) and len(mine) == 14
    rank = handle.model.peft_config["default"].r
    ranks = {name: theirs[name][0].shape[0] if name in theirs else 0 for name in mine}
    assert rank == max(ranks.values())
    if rho == 1.0:
        assert set(ranks.values()) == {4}
    else:
        assert len(set(ranks.values())) > 1, "rho 2 redistributes the ranks on this model"
    for name, layer in mine.items():
        a = layer.lora_A["default"].weight.detach().numpy()
        assert a.shape[0] == rank and not layer.lora_B["default"].weight.detach().numpy().any()
        r_i = ranks[name]
        if r_i:
            np.testing.assert_allclose(a[:r_i], theirs[name][0], atol=1e-5, err_msg=name)
            assert layer.scaling["default"] == pytest.approx(theirs[name][1], rel=1e-12)
        assert not a[r_i:].any(), f"{name}: padding rows are zero"
    # With the same B on both (ours padded with values its zero rows of A cancel), the same logits.
    rng = np.random.default_rng(0)
    for name, layer in mine.items():
        b = rng.normal(0, 0.1, layer.lora_B["default"].weight.shape).astype(np.float32)
        r_i = ranks[name]
        if r_i:
            theirs_layer = theirs_model.get_base_model().get_submodule(name)
            theirs_layer.lora_B["default"].weight.data = torch.from_numpy(b[:, :r_i].copy())
        layer.lora_B["default"].weight.data = torch.from_numpy(b)
    batch = random_batch(320, seed=9)
    with torch.no_grad():
        expected = theirs_model(input_ids=torch.as_tensor(batch.input_ids),
                                attention_mask=torch.as_tensor(batch.attention_mask)).logits.numpy()
    np.testing.assert_allclose(backend.logits(handle, batch), expected, atol=1e-5)


def plain_peft(model_dir, adapter_dir, batch):
    """(the base's logits, the logits of plain PEFT's reload of the adapter on it, its LoraConfig)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        before = base(input_ids=torch.as_tensor(batch.input_ids)).logits.numpy()
        plain = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
        logits = plain(input_ids=torch.as_tensor(batch.input_ids),
                       attention_mask=torch.as_tensor(batch.attention_mask)).logits.numpy()
    return before, logits, plain.peft_config["default"]


def test_trained_eva_adapter_reloads_in_plain_peft_with_the_same_logits(tiny_config, tiny_model_dir, tmp_path):
    from mudpuppy.data import Batcher, load_data, prepare_sft_data
    from mudpuppy.training.sft import eva_batches

    tiny_config["adapter"].update(init="eva", r=4, alpha=8)
    cfg = load_config(tiny_config)
    backend = create_backend("cpu")
    handle = backend.load_model(cfg.model, "fp32", adapter=cfg.adapter)
    data = prepare_sft_data(cfg, handle.tokenizer, load_data(cfg, "sft"))
    backend.attach_adapter(handle, cfg.adapter, batches=eva_batches(cfg, data.train, handle.tokenizer.pad_token_id))
    trainer = backend.create_trainer(handle, cfg.training)
    batcher = Batcher.from_config(data.train, cfg, handle.tokenizer.pad_token_id)
    for _ in range(3):
        trainer.step([batcher.next_batch()], 5e-3)
    batch = random_batch(len(handle.tokenizer))
    trained = backend.logits(handle, batch)
    backend.save_adapter(handle, str(tmp_path / "adapter"))
    before, logits, config = plain_peft(tiny_model_dir, tmp_path / "adapter", batch)
    assert config.init_lora_weights is True and not config.rank_pattern and config.r == handle.model.peft_config["default"].r
    assert np.abs(logits - before).max() > 1e-3, "three steps moved the model"
    np.testing.assert_allclose(logits, trained, atol=1e-5)


def test_eva_is_refused_outside_sft_and_with_what_it_cannot_carry(tiny_config):
    tiny_config.update(method="preference", adapter={"type": "lora", "init": "eva"}, preference={"type": "dpo"})
    with pytest.raises(Exception, match=r"adapter\.init eva: .*method preference"):
        load_config(tiny_config)
    with pytest.raises(Exception, match="eva_rho"):
        AdapterConfig(init="pissa", eva_rho=2)
    with pytest.raises(Exception, match="rslora"):
        AdapterConfig(init="eva", rslora=True)
    assert AdapterConfig(init="eva", rslora=True, eva_rho=1).rho == 1.0
    with pytest.raises(Exception, match="use lora"):
        AdapterConfig(type="qlora", init="eva")


@pytest.mark.mlx
def test_mlx_starts_from_torch_s_eva_and_saves_what_plain_peft_reads(tiny_model_dir, tmp_path):
    mx = pytest.importorskip("mlx.core")
    from mudpuppy.backends.mlx.layers import adapter_layers

    backend, handle = ours(tiny_model_dir, fixed_batches(320))
    mlx_backend = create_backend("mlx")
    mh = mlx_backend.load_model(ModelConfig(base_model=str(tiny_model_dir)), "fp32")
    mlx_backend.attach_adapter(mh, AdapterConfig(type="lora", r=4, alpha=8, init="eva", eva_rho=RHO),
                               batches=fixed_batches(320))
    mine, torch_layers = adapter_layers(mh.model), lora_layers(handle)
    assert set(mine) == set(torch_layers)
    rng = np.random.default_rng(1)
    for path, layer in mine.items():
        np.testing.assert_allclose(np.array(layer.lora_a.T), torch_layers[path].lora_A["default"].weight.detach().numpy(),
                                   atol=1e-6)
        layer.lora_b = mx.array(rng.normal(0, 0.05, layer.lora_b.shape).astype(np.float32))
    batch = random_batch(320, seed=3)
    expected = mlx_backend.logits(mh, batch)
    mlx_backend.save_adapter(mh, str(tmp_path / "adapter"))
    _, logits, _ = plain_peft(tiny_model_dir, tmp_path / "adapter", batch)
    np.testing.assert_allclose(logits, expected, atol=1e-4)


def test_an_eva_run_resumes_bit_for_bit(tiny_config, tmp_path):
    """The recipe hands EVA the training batches; a resumed run computes the same start (so the same rank),
    then loads the trained factors, and ends on the same adapter as the run that went straight through."""
    from safetensors.numpy import load_file

    from .test_loraplus import loraplus_config, straight_and_resumed

    cfg = loraplus_config(tiny_config, tmp_path, init="eva")
    del cfg["training"]["loraplus_lr_ratio"]
    straight, resumed = straight_and_resumed(cfg, "cpu", "cpu", tmp_path)
    assert resumed.resumed_from == 3 and resumed.losses == straight.losses
    a, b = (load_file(str(tmp_path / name / "adapter_model.safetensors")) for name in ("straight", "moved"))
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
