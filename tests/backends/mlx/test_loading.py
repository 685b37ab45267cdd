"""Loading on MLX at storage precision: QLoRA quantized while reading, no full-precision copy, and
the options MLX cannot honour refused by `create` before any model loads."""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

mx = pytest.importorskip("mlx.core")

from mlx.utils import tree_flatten

from mudpuppy import create_backend
from mudpuppy.backends.mlx.layers import adapter_layers
from mudpuppy.cli import main
from mudpuppy.config import AdapterConfig, MemoryConfig
from mudpuppy.errors import MudpuppyError

from ...conftest import build_tiny_model
from .conftest import model_cfg, random_batch

pytestmark = pytest.mark.mlx


@pytest.fixture(scope="module")
def wider_model_dir(tmp_path_factory):
    """256 wide: the linear weights outweigh embeddings and norms, so a full-precision copy shows."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-256"), hidden_size=256)


def params(handle) -> dict:
    return dict(tree_flatten(handle.model.parameters()))


def peak_of(load) -> tuple[object, int]:
    """What `load()` returns, and the most MLX memory it held beyond what was held before it."""
    gc.collect()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    result = load()
    return result, mx.get_peak_memory() - before


def assert_same_arrays(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert value.dtype == theirs[key].dtype, key
        assert mx.array_equal(value, theirs[key]).item(), key


@pytest.mark.parametrize("quant_backend", ["int4", "mxfp4"])
def test_qlora_quantized_while_loading_equals_quantizing_after(wide_model_dir, mlx_backend, quant_backend):
    adapter = AdapterConfig(type="qlora", quant_backend=quant_backend, r=4)
    after = mlx_backend.load_model(model_cfg(wide_model_dir), "fp32")
    summary = mlx_backend.quantize_base(after, adapter)
    mx.eval(after.model.parameters())
    loaded = mlx_backend.load_model(model_cfg(wide_model_dir), "fp32", adapter=adapter)
    assert loaded.quantization == summary and summary["quantized"] == 14
    assert_same_arrays(params(loaded), params(after))
    batch = random_batch(len(loaded.tokenizer))
    assert np.array_equal(mlx_backend.logits(loaded, batch), mlx_backend.logits(after, batch))

    # quantize_base on a base quantized while loading: the summary, and not a second quantization.
    before = params(loaded)
    assert mlx_backend.quantize_base(loaded, adapter) == summary
    assert all(value is before[key] for key, value in params(loaded).items())
    other = AdapterConfig(type="qlora", quant_backend="mxfp4" if quant_backend == "int4" else "int4", r=4)
    with pytest.raises(MudpuppyError, match=f"already quantized to {quant_backend}"):
        mlx_backend.quantize_base(loaded, other)
    with pytest.raises(MudpuppyError, match="quantized for QLoRA when it was loaded"):
        mlx_backend.attach_adapter(loaded, AdapterConfig(type="lora", r=4))


def test_qlora_load_peaks_at_the_4bit_model_plus_about_one_layer(wider_model_dir, mlx_backend):
    adapter = AdapterConfig(type="qlora", r=4)
    loaded, lazy_peak = peak_of(lambda: mlx_backend.load_model(model_cfg(wider_model_dir), "fp32", adapter=adapter))
    stored = sum(v.nbytes for v in params(loaded).values())
    del loaded

    def load_then_quantize():
        full = mlx_backend.load_model(model_cfg(wider_model_dir), "fp32")
        weights = params(full)
        mlx_backend.quantize_base(full, adapter)
        mx.eval(full.model.parameters())
        return weights

    fp32, eager_peak = peak_of(load_then_quantize)
    largest = max(v.nbytes for v in fp32.values())          # one fp32 linear weight
    total = sum(v.nbytes for v in fp32.values())
    assert lazy_peak < stored + 2 * largest < total / 2
    assert eager_peak >= total                                # what loading first, quantizing after costs


def test_auto_dtype_keeps_a_frozen_base_in_the_compute_dtype(wider_model_dir, mlx_backend):
    lora = AdapterConfig(type="lora", r=4)
    loaded, peak = peak_of(lambda: mlx_backend.load_model(model_cfg(wider_model_dir), "bf16", adapter=lora))
    stored = params(loaded)
    assert all(v.dtype == mx.bfloat16 for v in stored.values())
    largest_fp32 = 2 * max(v.nbytes for v in stored.values())
    assert peak < sum(v.nbytes for v in stored.values()) + 2 * largest_fp32   # never a whole fp32 copy

    # The same base as a full fp32 load cast afterwards (what attach_adapter did before).
    fp32 = params(mlx_backend.load_model(model_cfg(wider_model_dir), "fp32"))
    assert_same_arrays(stored, {k: v.astype(mx.bfloat16) for k, v in fp32.items()})

    # Weights trained in full keep fp32; a new scalar head trains in full beside a bf16 base.
    full = mlx_backend.load_model(model_cfg(wider_model_dir), "fp32", adapter=AdapterConfig(type="none"))
    assert all(v.dtype == mx.float32 for v in params(full).values())
    scored = mlx_backend.load_model(model_cfg(wider_model_dir), "bf16", head="sequence_classification", adapter=lora)
    dtypes = {k: v.dtype for k, v in params(scored).items()}
    assert dtypes["score.weight"] == mx.float32 and dtypes["model.embed_tokens.weight"] == mx.bfloat16


def test_merge_rebuilds_the_base_the_qlora_adapter_trained_on(tiny_config, wide_model_dir, mlx_backend, tmp_path):
    from mudpuppy import load_config
    from mudpuppy.training.merge import merge_run

    tiny_config["model"]["base_model"] = str(wide_model_dir)
    tiny_config["adapter"]["type"] = "qlora"
    cfg = load_config(tiny_config)
    trained = mlx_backend.load_model(cfg.model, "fp32", adapter=cfg.adapter)
    mlx_backend.attach_adapter(trained, cfg.adapter)
    for layer in adapter_layers(trained.model).values():
        layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.1   # an adapter that changes the weights
    mlx_backend.save_adapter(trained, str(tmp_path / "adapter"))

    merged = merge_run(cfg, mlx_backend, str(tmp_path / "adapter"), str(tmp_path / "merged"), "float32")
    # The order before quantizing while loading: a full fp32 load, then the 4-bit base.
    reference = mlx_backend.load_model(cfg.model, "fp32")
    mlx_backend.quantize_base(reference, cfg.adapter)
    mlx_backend.load_adapter(reference, str(tmp_path / "adapter"))
    mlx_backend.merge_and_save(reference, str(tmp_path / "reference"), "float32")
    ours = mx.load(str(merged / "model.safetensors"))
    theirs = mx.load(str(tmp_path / "reference" / "model.safetensors"))
    assert_same_arrays(ours, theirs)


def test_create_refuses_offload_and_streaming_by_key(mlx_backend):
    memory = MemoryConfig(optimizer_offload=True, stream_layers=True)
    with pytest.raises(MudpuppyError) as err:
        create_backend("mlx", memory=memory)
    message = str(err.value)
    assert message.startswith("memory.optimizer_offload, memory.stream_layers: the mlx backend runs on unified memory")
    assert "no host memory to offload or stream to" in message and "turn them off" in message
    create_backend("mlx", memory=MemoryConfig())    # nothing asked: nothing refused


@pytest.mark.parametrize("optimizer, cls", [("adamw_8bit", "AdamW8bit"), ("adamw_4bit", "AdamW4bit")])
def test_create_refuses_torchao_optimizers(mlx_backend, optimizer, cls):
    with pytest.raises(MudpuppyError, match=f"training.optimizer: {optimizer} on the mlx backend uses torchao's {cls}"):
        create_backend("mlx", optimizer=optimizer)


@pytest.mark.parametrize("change, message", [
    ({"memory": {"activation_offload": True}}, "memory.activation_offload: the mlx backend runs on unified memory"),
    ({"training": {"optimizer": "adamw_8bit"}}, "training.optimizer: adamw_8bit on the mlx backend"),
])
def test_cli_refuses_them_before_any_model_loads(mlx_config, mlx_backend, tmp_path, monkeypatch, change, message):
    from mudpuppy.backends.mlx.backend import MlxBackend

    def no_loading(*_args, **_kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(MlxBackend, "load_model", no_loading)
    for section, values in change.items():
        mlx_config.setdefault(section, {}).update(values)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(json.loads(json.dumps(mlx_config))))
    res = CliRunner().invoke(main, ["run", "--config", str(path)])
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("method", ["gptq", "mudpuppy_qat"])
def test_a_gptq_or_qat_checkpoint_is_refused_by_name_not_loaded_with_missing_weights(tiny_model_dir, mlx_backend,
                                                                                     tmp_path, method):
    import shutil

    from mudpuppy.config import ModelConfig

    quantized = tmp_path / "quantized"
    shutil.copytree(tiny_model_dir, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(MudpuppyError, match=f"holds {method} weights.*use a torch backend"):
        mlx_backend.load_model(ModelConfig(base_model=str(quantized)), "fp32")
