"""adapter.init loftq: on mudpuppy's own 4-bit base (torch and MLX), A, B are what PEFT's `_loftq_init_new`
computes from the same weight and dequantized base (bitsandbytes stood in for by that base), divided by the
LoRA scale; with adapter.loftq_iter, A, B and the changed 4-bit base are PEFT's `loftq_init` with
bitsandbytes' quantizer stood in for by the runtime's; on a tiny Llama the start is closer to the full-precision model than plain QLoRA's; a run resumes exactly and
the adapter merges onto the dequantized base."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from mudpuppy import create_backend, load_config
from mudpuppy.backends.adapters.init import canonical_signs, loftq_factors
from mudpuppy.config import AdapterConfig, ModelConfig

from ..conftest import build_tiny_model
from .mlx.conftest import random_batch

R, ALPHA = 4, 8


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> Path:
    """The tiny Llama at width 64: every linear layer's input a whole number of MLX's 64-value groups."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-64"), hidden_size=64)


def checkpoint(model_dir) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return {k: v.astype(np.float32) for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()}


def torch_qlora(model_dir, init, rslora=False, **extra):
    backend = create_backend("cpu")
    cfg = AdapterConfig(type="qlora", r=R, alpha=ALPHA, init=init, rslora=rslora, **extra)
    handle = backend.load_model(ModelConfig(base_model=str(model_dir)), "fp32", adapter=cfg)
    backend.attach_adapter(handle, cfg)
    return backend, handle


def torch_layers(handle) -> dict:
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in handle.model.base_model.model.named_modules() if isinstance(m, LoraLayer)}


class OnCpu(torch.Tensor):
    """A weight whose .to(device=...) stays on the CPU: PEFT sends it to "cuda" or "xpu"."""

    def to(self, *args, dtype=None, **kwargs):
        return torch.Tensor.to(self.as_subclass(torch.Tensor), dtype=dtype)


def peft_loftq(monkeypatch, weight: np.ndarray, dequantized: np.ndarray, r: int):
    """PEFT 0.21's own `_loftq_init_new` (A, B), bitsandbytes' dequantize_4bit returning `dequantized`."""
    from peft.utils import loftq_utils

    fake = types.ModuleType("bitsandbytes")
    fake.functional = types.SimpleNamespace(dequantize_4bit=lambda data, state: torch.from_numpy(dequantized))
    monkeypatch.setitem(sys.modules, "bitsandbytes", fake)
    monkeypatch.setattr(loftq_utils, "is_bnb_4bit_available", lambda: True)
    monkeypatch.setattr(loftq_utils, "is_xpu_available", lambda: False)
    monkeypatch.setattr(loftq_utils, "clear_device_cache", lambda: None)
    qweight = types.SimpleNamespace(data=None, quant_state=None)
    a, b = loftq_utils._loftq_init_new(qweight, torch.from_numpy(weight).as_subclass(OnCpu), num_bits=4,
                                       reduced_rank=r)
    return a.numpy(), b.numpy()


@pytest.mark.parametrize("rslora", [False, True])
def test_torch_factors_are_peft_s_own_loftq_over_the_scale(wide_model_dir, monkeypatch, rslora):
    _, handle = torch_qlora(wide_model_dir, "loftq", rslora)
    weights, scale = checkpoint(wide_model_dir), ALPHA / (R ** 0.5 if rslora else R)
    layers = torch_layers(handle)
    assert len(layers) == 14
    for name, layer in layers.items():
        assert layer.scaling["default"] == pytest.approx(scale)
        dequantized = layer.get_base_layer().dequantize(torch.float32).numpy()
        a, b = peft_loftq(monkeypatch, weights[f"{name}.weight"], dequantized, R)
        # PEFT's A, B are unscaled (scale * B @ A = scale * E_r): ours are each over sqrt(scale).
        a, b = canonical_signs(a / np.sqrt(scale), b / np.sqrt(scale))
        np.testing.assert_allclose(layer.lora_A["default"].weight.detach().numpy(), a, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(layer.lora_B["default"].weight.detach().numpy(), b, atol=1e-5, err_msg=name)


def test_at_scale_one_the_factors_are_peft_s_exactly(monkeypatch):
    rng = np.random.default_rng(0)
    w = (0.2 * rng.standard_normal((24, 64))).astype(np.float32)
    q = (w + 0.01 * rng.standard_normal(w.shape)).astype(np.float32)
    ours = loftq_factors(w, q, R, 1.0)
    for mine, peft in zip(ours, canonical_signs(*peft_loftq(monkeypatch, w, q, R))):
        np.testing.assert_allclose(mine, peft, atol=1e-5)


def peft_loftq_init(monkeypatch, weight: np.ndarray, roundtrip, r: int, iters: int):
    """PEFT 0.21's own `loftq_init` (base, A, B) for num_iter=iters, bitsandbytes' NF4 stood in for by
    `roundtrip` (x -> dequantize(quantize(x)) in the runtime's own 4-bit format)."""
    from peft.utils import loftq_utils

    class Params4bit:
        def __init__(self, data, **_):
            self.data, self.quant_state = torch.from_numpy(roundtrip(data.numpy())), None

        def to(self, *_):
            return self

    fake = types.ModuleType("bitsandbytes")
    fake.nn = types.SimpleNamespace(Params4bit=Params4bit)
    fake.functional = types.SimpleNamespace(dequantize_4bit=lambda data, state: data)
    monkeypatch.setitem(sys.modules, "bitsandbytes", fake)
    for name in ("is_bnb_available", "is_bnb_4bit_available"):
        monkeypatch.setattr(loftq_utils, name, lambda: True)
    monkeypatch.setattr(loftq_utils, "is_xpu_available", lambda: False)
    monkeypatch.setattr(loftq_utils, "clear_device_cache", lambda: None)
    base, a, b = loftq_utils.loftq_init(torch.from_numpy(weight).as_subclass(OnCpu), num_bits=4, reduced_rank=r,
                                        num_iter=iters)
    return base.as_subclass(torch.Tensor).numpy(), a.numpy(), b.numpy()


def torch_roundtrip(x: np.ndarray) -> np.ndarray:
    from mudpuppy.backends.torch.quantization.formats import dequantize_weight, quantize_weight

    t = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    return dequantize_weight(quantize_weight(t, "int4", 64), "int4", t.shape[1], torch.float32).numpy()


@pytest.mark.parametrize("iters", [1, 2, 3])
def test_torch_iterations_are_peft_s_loftq_init(wide_model_dir, monkeypatch, iters):
    _, handle = torch_qlora(wide_model_dir, "loftq", loftq_iter=iters)
    weights, scale = checkpoint(wide_model_dir), ALPHA / R
    layers = torch_layers(handle)
    assert len(layers) == 14
    moved = 0
    for name, layer in layers.items():
        weight = weights[f"{name}.weight"]
        base = layer.get_base_layer().dequantize(torch.float32).numpy()
        peft_base, a, b = peft_loftq_init(monkeypatch, weight, torch_roundtrip, R, iters)
        np.testing.assert_allclose(base, peft_base, atol=1e-5, err_msg=name)
        moved += not np.array_equal(base, torch_roundtrip(weight))
        a, b = canonical_signs(a / np.sqrt(scale), b / np.sqrt(scale))
        np.testing.assert_allclose(layer.lora_A["default"].weight.detach().numpy(), a, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(layer.lora_B["default"].weight.detach().numpy(), b, atol=1e-5, err_msg=name)
    # One iteration keeps the base as loaded; more requantize W minus the low-rank part, a new base.
    assert moved == (0 if iters == 1 else len(layers))


def test_loftq_iter_is_checked(tiny_config):
    assert AdapterConfig(type="qlora", init="loftq").loftq_iter == 1
    for bad in (0, -1, 1.5, "two", True):
        with pytest.raises(ValidationError, match="loftq_iter"):
            AdapterConfig(type="qlora", init="loftq", loftq_iter=bad)
    with pytest.raises(ValidationError, match="applies to init loftq"):
        AdapterConfig(type="qlora", loftq_iter=2)
    tiny_config["adapter"].update(type="lora", init="pissa", loftq_iter=3)
    with pytest.raises(Exception, match=r"adapter[\s\S]*loftq_iter is LoftQ's number of iterations") as info:
        load_config(tiny_config)
    assert "init pissa" in str(info.value)


def error_norms(weight, dequantized, delta) -> tuple[float, float]:
    return float(np.linalg.norm(weight - dequantized)), float(np.linalg.norm(weight - dequantized - delta))


def test_torch_start_reduces_each_layer_s_error_and_the_logits_error(wide_model_dir):
    from transformers import AutoModelForCausalLM

    weights = checkpoint(wide_model_dir)
    backend, handle = torch_qlora(wide_model_dir, "loftq")
    for name, layer in torch_layers(handle).items():
        plain, corrected = error_norms(weights[f"{name}.weight"],
                                       layer.get_base_layer().dequantize(torch.float32).numpy(),
                                       layer.get_delta_weight("default").detach().numpy())
        assert corrected < 0.95 * plain, name
    batch = random_batch(len(handle.tokenizer))
    full = AutoModelForCausalLM.from_pretrained(str(wide_model_dir), dtype=torch.float32)
    with torch.no_grad():
        expected = full(input_ids=torch.as_tensor(batch.input_ids),
                        attention_mask=torch.as_tensor(batch.attention_mask)).logits.numpy()
    mask = batch.attention_mask.astype(bool)
    loftq = np.abs(backend.logits(handle, batch) - expected)[mask].mean()
    backend, handle = torch_qlora(wide_model_dir, "default")
    qlora = np.abs(backend.logits(handle, batch) - expected)[mask].mean()
    assert loftq < qlora, (loftq, qlora)


@pytest.mark.parametrize("kind", ["lora", "dora", "none"])
def test_loftq_needs_qlora(tiny_config, kind):
    with pytest.raises(ValidationError, match="use adapter.type qlora"):
        AdapterConfig(type=kind, init="loftq")
    tiny_config["adapter"].update(type=kind, init="loftq")
    with pytest.raises(Exception, match=r"adapter[\s\S]*init loftq") as info:
        load_config(tiny_config)
    assert f"adapter.type {kind}" in str(info.value)
    with pytest.raises(ValidationError, match="keep one"):
        AdapterConfig(type="qlora", init="loftq", init_from="somewhere")


@pytest.mark.parametrize("iters", [1, 2])
def test_a_loftq_run_resumes_bit_for_bit(tiny_config, tmp_path, iters):
    from .test_loraplus import adapters, loraplus_config, straight_and_resumed

    cfg = loraplus_config(tiny_config, tmp_path, type="qlora", init="loftq", loftq_iter=iters)
    del cfg["training"]["loraplus_lr_ratio"]
    straight, resumed = straight_and_resumed(cfg, "cpu", "cpu", tmp_path)
    assert (resumed.resumed_from, resumed.losses) == (3, straight.losses)
    straight_adapter, resumed_adapter = adapters(tmp_path)
    assert straight_adapter.keys() == resumed_adapter.keys()
    for key, value in straight_adapter.items():
        np.testing.assert_array_equal(value, resumed_adapter[key], err_msg=key)
    # A plain QLoRA adapter: PEFT reloads it with no LoftQ step (nor bitsandbytes).
    assert json.loads((tmp_path / "straight" / "adapter_config.json").read_text())["init_lora_weights"] is True


def test_the_adapter_merges_onto_the_dequantized_base(wide_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    backend, handle = torch_qlora(wide_model_dir, "loftq")
    batch = random_batch(len(handle.tokenizer), seed=2)
    expected = backend.logits(handle, batch)
    dequantized = {f"{n}.weight": l.get_base_layer().dequantize(torch.float32) + l.get_delta_weight("default")
                   for n, l in torch_layers(handle).items()}
    backend.merge_and_save(handle, str(tmp_path / "merged"), dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    state = merged.state_dict()
    for key, weight in dequantized.items():
        np.testing.assert_allclose(state[key].numpy(), weight.detach().numpy(), atol=1e-6, err_msg=key)
    with torch.no_grad():
        logits = merged(input_ids=torch.as_tensor(batch.input_ids),
                        attention_mask=torch.as_tensor(batch.attention_mask)).logits.numpy()
    mask = batch.attention_mask.astype(bool)
    np.testing.assert_allclose(logits[mask], expected[mask], atol=1e-4)


def trained_weights(runtime: str, handle) -> dict[str, np.ndarray]:
    """B moved off LoftQ's start (a trained adapter); each target's dequantized base + scale * B @ A."""
    if runtime == "mlx":
        import mlx.core as mx

        from mudpuppy.backends.mlx.layers import adapter_layers, base_weight

        out = {}
        for path, layer in adapter_layers(handle.model).items():
            layer.lora_b = layer.lora_b + 0.05 * mx.random.normal(layer.lora_b.shape)
            out[f"{path}.weight"] = np.array(base_weight(layer.linear).astype(mx.float32)) + np.array(
                layer.scale * (layer.lora_a @ layer.lora_b).T)
        return out
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in torch_layers(handle).values():
            layer.lora_B["default"].weight.add_(0.05 * torch.randn_like(layer.lora_B["default"].weight))
        return {f"{n}.weight": (l.get_base_layer().dequantize(torch.float32) + l.get_delta_weight("default")).numpy()
                for n, l in torch_layers(handle).items()}


@pytest.mark.parametrize("runtime", ["cpu", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_mudpuppy_merge_rebuilds_the_base_loftq_iterations_left(wide_model_dir, tiny_config, tmp_path, runtime):
    """`mudpuppy merge` (and exports, evals: the same loader) of a loftq_iter 2 run folds the adapter into
    the 4-bit base the iterations left, not into the checkpoint quantized again."""
    from safetensors.numpy import load_file

    from mudpuppy.training.merge import merge_run

    if runtime == "mlx":
        pytest.importorskip("mlx.core")
    tiny_config["model"]["base_model"] = str(wide_model_dir)
    tiny_config["adapter"].update(type="qlora", r=R, alpha=ALPHA, init="loftq", loftq_iter=2)
    cfg = load_config(tiny_config)
    backend = create_backend(runtime)
    handle = backend.load_model(cfg.model, "fp32", adapter=cfg.adapter)
    backend.attach_adapter(handle, cfg.adapter)
    expected = trained_weights(runtime, handle)
    backend.save_adapter(handle, str(tmp_path / "adapter"))
    merged = merge_run(cfg, create_backend(runtime), str(tmp_path / "adapter"), str(tmp_path / "merged"), "float32")
    state = load_file(str(merged / "model.safetensors"))
    for key, weight in expected.items():
        np.testing.assert_allclose(state[key], weight, atol=1e-5, err_msg=key)


@pytest.mark.mlx
def test_mlx_corrects_its_own_quantizer_s_error(wide_model_dir):
    mx = pytest.importorskip("mlx.core")
    from mudpuppy.backends.mlx.layers import adapter_layers, base_weight

    weights = checkpoint(wide_model_dir)
    backend = create_backend("mlx")
    cfg = AdapterConfig(type="qlora", r=R, alpha=ALPHA, init="loftq")
    handle = backend.load_model(ModelConfig(base_model=str(wide_model_dir)), "fp32", adapter=cfg)
    backend.attach_adapter(handle, cfg)
    _, torch_handle = torch_qlora(wide_model_dir, "loftq")
    torch_bases = {n: l.get_base_layer().dequantize(torch.float32).numpy() for n, l in torch_layers(torch_handle).items()}
    layers = adapter_layers(handle.model)
    assert set(layers) == set(torch_bases)
    for path, layer in layers.items():
        weight, base = weights[f"{path}.weight"], np.array(base_weight(layer.linear).astype(mx.float32))
        assert np.abs(base - torch_bases[path]).max() > 1e-3, "the two runtimes' 4-bit bases differ"
        a, b = loftq_factors(weight, base, R, ALPHA / R)
        np.testing.assert_allclose(np.array(layer.lora_a.T), a, atol=1e-5, err_msg=path)
        np.testing.assert_allclose(np.array(layer.lora_b.T), b, atol=1e-5, err_msg=path)
        plain, corrected = error_norms(weight, base, layer.scale * (b @ a))
        assert corrected < 0.95 * plain, path
    batch = random_batch(len(handle.tokenizer))
    full_backend = create_backend("mlx")
    full = full_backend.load_model(ModelConfig(base_model=str(wide_model_dir)), "fp32")
    expected = full_backend.logits(full, batch)
    mask = batch.attention_mask.astype(bool)
    loftq = np.abs(backend.logits(handle, batch) - expected)[mask].mean()
    plain_cfg = AdapterConfig(type="qlora", r=R, alpha=ALPHA)
    plain = backend.load_model(ModelConfig(base_model=str(wide_model_dir)), "fp32", adapter=plain_cfg)
    backend.attach_adapter(plain, plain_cfg)
    assert loftq < np.abs(backend.logits(plain, batch) - expected)[mask].mean()


@pytest.mark.mlx
def test_mlx_iterations_are_peft_s_loftq_init_on_mlx_s_quantizer(wide_model_dir, monkeypatch):
    mx = pytest.importorskip("mlx.core")
    from mudpuppy.backends.mlx.layers import adapter_layers, base_weight

    weights = checkpoint(wide_model_dir)
    backend = create_backend("mlx")
    cfg = AdapterConfig(type="qlora", r=R, alpha=ALPHA, init="loftq", loftq_iter=2)
    handle = backend.load_model(ModelConfig(base_model=str(wide_model_dir)), "fp32", adapter=cfg)
    backend.attach_adapter(handle, cfg)
    layers = adapter_layers(handle.model)
    assert len(layers) == 14
    for path, layer in layers.items():
        q = layer.linear

        def roundtrip(x, q=q):
            packed = mx.quantize(mx.array(x), group_size=q.group_size, bits=q.bits, mode=q.mode)
            return np.array(mx.dequantize(*packed, group_size=q.group_size, bits=q.bits, mode=q.mode))

        weight = weights[f"{path}.weight"]
        peft_base, a, b = peft_loftq_init(monkeypatch, weight, roundtrip, R, 2)
        base = np.array(base_weight(q).astype(mx.float32))
        np.testing.assert_allclose(base, peft_base, atol=1e-5, err_msg=path)
        assert not np.array_equal(base, roundtrip(weight)), path
        a, b = canonical_signs(a / np.sqrt(ALPHA / R), b / np.sqrt(ALPHA / R))
        np.testing.assert_allclose(np.array(layer.lora_a.T), a, atol=1e-5, err_msg=path)
        np.testing.assert_allclose(np.array(layer.lora_b.T), b, atol=1e-5, err_msg=path)


def test_parity_s_second_side_starts_from_the_first_side_s_factors(wide_model_dir, tmp_path):
    """`mudpuppy parity` attaches the second side with init_from the first side's saved start: that start
    is kept, not replaced by this runtime's own LoftQ factors."""
    backend, handle = torch_qlora(wide_model_dir, "loftq")
    backend.save_adapter(handle, str(tmp_path / "init"))
    saved = {n: l.lora_B["default"].weight.detach().clone() for n, l in torch_layers(handle).items()}
    cfg = AdapterConfig(type="qlora", r=R, alpha=ALPHA, init="loftq").model_copy(
        update={"init_from": str(tmp_path / "init"), "init": "loftq"})
    second = create_backend("cpu")
    h2 = second.load_model(ModelConfig(base_model=str(wide_model_dir)), "fp32", adapter=cfg)
    from mudpuppy.backends.torch.quantization.linear4bit import Linear4bit

    with torch.no_grad():
        for layer in h2.model.modules():
            if isinstance(layer, Linear4bit):
                layer.qweight.zero_()      # another base: its own LoftQ factors would differ
    second.attach_adapter(h2, cfg)
    for name, layer in torch_layers(h2).items():
        assert torch.equal(layer.lora_B["default"].weight, saved[name]), name
