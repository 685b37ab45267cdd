"""Fitting real sizes: loading at storage precision, QLoRA while loading, and the memory features.

Every memory feature must train exactly like the run without it (fp32, 1e-5).
This machine has no GPU, so host and device are both the CPU: the features are
switched on in the device plan directly (the cpu backend refuses them from a
config, since there is nothing to offload to), and every "copy to host" is a
real copy, so the mechanism tested is the one a GPU run uses.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from mudpuppy import create_backend, load_config, run
from mudpuppy.backends.torch import memory as memory_mod
from mudpuppy.backends.torch.model.frozen import FrozenLinear, StoredLinear
from mudpuppy.backends.torch.quantization.linear4bit import Linear4bit, quantize_model
from mudpuppy.cli import main
from mudpuppy.config import AdapterConfig, MemoryConfig, ModelConfig
from mudpuppy.errors import MudpuppyError

QUIET = {"echo": lambda *_: None}


@pytest.fixture(scope="module")
def bf16_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model saved as a bf16 checkpoint, as hub models are."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("tiny-bf16")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    for path in tiny_model_dir.iterdir():     # the tokenizer and its chat template
        if not (out / path.name).exists():
            shutil.copy(path, out / path.name)
    return out


def ids():
    return torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29], [2, 4, 6, 8, 10, 12, 14, 16]])


def logits_of(model):
    with torch.no_grad():
        return model(input_ids=ids()).logits.float()


# ------------------------------------------------------------------ loading


def test_tensor_by_tensor_loader_gives_from_pretrained_logits(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    handle = create_backend("cpu").load_model(ModelConfig(base_model=str(tiny_model_dir)), "fp32")
    assert handle.load_report.path == "streamed" and handle.load_report.tensors > 0
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    assert torch.equal(logits_of(handle.model), logits_of(reference))
    # Tied embeddings stay tied: one tensor, not two copies.
    assert handle.model.lm_head.weight is handle.model.model.embed_tokens.weight


def test_a_new_scalar_head_is_initialised_in_fp32_and_the_base_is_read(tiny_model_dir):
    from transformers import AutoModelForSequenceClassification

    backend = create_backend("cpu")
    backend.seed(0)
    handle = backend.load_model(ModelConfig(base_model=str(tiny_model_dir)), "bf16", head="sequence_classification",
                                adapter=AdapterConfig(type="lora"))
    assert handle.load_report.new_keys == ["score.weight"]
    score = handle.model.score.weight
    assert score.dtype == torch.float32 and score.abs().sum() > 0 and score.std() < 1.0
    reference = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1)
    assert torch.equal(handle.model.model.embed_tokens.weight.float(),
                       reference.model.embed_tokens.weight.to(torch.bfloat16).float())


@pytest.mark.parametrize("adapter,precision,expected", [
    ("lora", "bf16", torch.bfloat16),      # a frozen base is stored as the device computes
    ("none", "bf16", torch.float32),       # full fine-tuning keeps fp32 master weights
    ("lora", "fp32", torch.float32),
])
def test_auto_dtype_stores_the_base_as_it_is_used(tiny_model_dir, adapter, precision, expected):
    backend = create_backend("cpu")
    handle = backend.load_model(ModelConfig(base_model=str(tiny_model_dir)), precision,
                                adapter=AdapterConfig(type=adapter))
    dtypes = {p.dtype for p in handle.model.parameters()}
    assert dtypes == {expected}
    if adapter != "none":
        backend.attach_adapter(handle, AdapterConfig(type=adapter, r=4, alpha=8))
        trainable = {p.dtype for p in handle.model.parameters() if p.requires_grad}
        assert trainable == {torch.float32}, "LoRA weights train in fp32 master weights"


def test_a_bf16_checkpoint_computed_in_fp32_stays_bf16_and_gives_the_same_logits(bf16_model_dir):
    """No native bf16 matmuls (fp32 compute): frozen linears keep the checkpoint's bf16, upcast per use."""
    from transformers import AutoModelForCausalLM

    handle = create_backend("cpu").load_model(ModelConfig(base_model=str(bf16_model_dir)), "fp32",
                                              adapter=AdapterConfig(type="lora"))
    stored = [m for m in handle.model.modules() if isinstance(m, StoredLinear)]
    assert len(stored) == 15 and all(m.stored.dtype == torch.bfloat16 and not m.streamed for m in stored)
    # The embedding too, and the tied output head reads that same tensor, a chunk of rows at a time.
    embedding = handle.model.get_input_embeddings().weight
    head = handle.model.get_output_embeddings()
    assert embedding.dtype == torch.bfloat16 and head.row_chunk and head.stored.data_ptr() == embedding.data_ptr()
    reference = AutoModelForCausalLM.from_pretrained(str(bf16_model_dir), dtype=torch.float32)
    torch.testing.assert_close(logits_of(handle.model), logits_of(reference), rtol=0, atol=1e-5)


@pytest.mark.parametrize("quant", ["int4", "mxfp4"])
def test_qlora_quantized_while_loading_equals_quantizing_after(bf16_model_dir, quant):
    from transformers import AutoModelForCausalLM

    adapter = AdapterConfig(type="qlora", quant_backend=quant)
    handle = create_backend("cpu").load_model(ModelConfig(base_model=str(bf16_model_dir)), "fp32", adapter=adapter)
    loaded = {n: m for n, m in handle.model.named_modules() if isinstance(m, Linear4bit)}
    assert len(loaded) == 14
    after = AutoModelForCausalLM.from_pretrained(str(bf16_model_dir), dtype=torch.float32)
    quantize_model(after, quant, adapter.quant_group_size if quant == "int4" else None, skip_modules=("lm_head",))
    for name, layer in loaded.items():
        other = after.get_submodule(name)
        for key, tensor in layer.quantized_tensors().items():
            assert torch.equal(tensor, other.quantized_tensors()[key]), (name, key)
    assert torch.equal(logits_of(handle.model), logits_of(after))


def test_frozen_layer_weights_cannot_be_written(bf16_model_dir):
    handle = create_backend("cpu").load_model(ModelConfig(base_model=str(bf16_model_dir)), "fp32",
                                              adapter=AdapterConfig(type="lora"))
    layer = next(m for m in handle.model.modules() if isinstance(m, FrozenLinear))
    with pytest.raises(MudpuppyError, match="densify_frozen_linears"):
        layer.weight.data += 1


# ------------------------------------------------------------------ training exactly like without


def short_run(cfg: dict, tmp_path, name: str, memory: MemoryConfig | None = None, model_dir=None, **training):
    cfg = {**cfg, "output_dir": str(tmp_path / name), "eval": {"before_training": False, "after_training": False},
           "training": {**cfg["training"], "max_steps": 3, **training}}
    if model_dir is not None:
        cfg["model"] = {"base_model": str(model_dir)}
    backend = create_backend("cpu")
    backend.plan.memory = memory          # what a GPU plan carries; the cpu backend refuses it from a config
    result = run(load_config(cfg), backend, **QUIET)
    trained = {n: p.detach().clone() for n, p in result.model.model.named_parameters() if p.requires_grad}
    return result, trained


def assert_same_training(a, b):
    (ra, wa), (rb, wb) = a, b
    np.testing.assert_allclose(ra.losses, rb.losses, rtol=1e-5, atol=0)
    assert wa.keys() == wb.keys() and wa
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6, msg=name)


def count_copies(monkeypatch) -> list[int]:
    calls = [0]
    real = memory_mod.copy_to

    def counting(tensor, host, pin):
        calls[0] += 1
        return real(tensor, host, pin)

    monkeypatch.setattr(memory_mod, "copy_to", counting)
    return calls


@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_streamed_layers_train_exactly_like_device_layers(tiny_config, tmp_path, adapter):
    tiny_config["adapter"] = {"type": adapter, "r": 4, "alpha": 8}
    plain = short_run(tiny_config, tmp_path, "plain")
    streamed = short_run(tiny_config, tmp_path, "streamed", MemoryConfig(stream_layers=True))
    layers = [m for m in streamed[0].model.model.modules() if isinstance(m, FrozenLinear)]
    assert len(layers) == 14
    if adapter == "lora":
        assert all(m.streamed for m in layers)
    else:
        assert all(m.stored is not None and not list(m.buffers()) for m in layers)
    assert_same_training(plain, streamed)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_activation_offload_trains_exactly_like_keeping_activations(tiny_config, tmp_path, monkeypatch, checkpointing):
    plain = short_run(tiny_config, tmp_path, "plain", gradient_checkpointing=checkpointing)
    copies = count_copies(monkeypatch)
    offloaded = short_run(tiny_config, tmp_path, "offloaded", MemoryConfig(activation_offload=True),
                          gradient_checkpointing=checkpointing)
    assert copies[0] > 0, "nothing went through host memory"
    assert_same_training(plain, offloaded)


def test_activation_offload_moves_each_checkpointed_layer_input(tiny_config, tmp_path, monkeypatch):
    moved = []
    real = memory_mod.ToHost.forward

    def recording(ctx, tensor, host, pin):
        moved.append(tuple(tensor.shape))
        return real(ctx, tensor, host, pin)

    monkeypatch.setattr(memory_mod.ToHost, "forward", staticmethod(recording))
    short_run(tiny_config, tmp_path, "offloaded", MemoryConfig(activation_offload=True), max_steps=1)
    # micro batch 4: one hidden-state tensor [4, T, 32] per layer, 2 layers.
    assert len(moved) == 2 and all(shape[0] == 4 and shape[-1] == 32 for shape in moved)


def test_offloaded_layer_inputs_keep_the_compute_devices_rng_in_the_checkpoint():
    """With every layer input in host memory, torch.utils.checkpoint would save and restore the CPU's RNG and
    autocast state only (it looks at its tensor arguments' devices), so on a GPU the recompute would draw other
    dropout masks. The offload hands it a tensor on the compute device too: here a 'meta' device stands in for
    the GPU, and torch's own inference of the device whose state it saves must name it."""
    from torch.utils.checkpoint import _infer_device_type

    offload = memory_mod.ActivationOffload(torch.device("meta"), torch.device("cpu"))
    seen = {}

    def checkpoint_fn(run, *args, **kwargs):
        seen["device"] = _infer_device_type(*args)
        return run(*args)

    hidden = torch.ones(2, 3)
    out = offload.checkpoint(checkpoint_fn, lambda h, scale: h * scale, hidden, 2.0)
    assert seen["device"] == "meta"
    assert torch.equal(out, hidden * 2.0)           # the layer gets its own arguments, the anchor is not one


@pytest.mark.parametrize("max_grad_norm", [1.0, None])
def test_optimizer_offload_trains_exactly_like_the_device_optimizer(tiny_config, tmp_path, max_grad_norm):
    from mudpuppy.backends.torch.optimizers import HostOffloadOptimizer

    plain = short_run(tiny_config, tmp_path, "plain", max_grad_norm=max_grad_norm)
    offloaded = short_run(tiny_config, tmp_path, "offloaded", MemoryConfig(optimizer_offload=True),
                          max_grad_norm=max_grad_norm)
    assert_same_training(plain, offloaded)
    backend = create_backend("cpu")
    backend.plan.memory = MemoryConfig(optimizer_offload=True)
    handle = backend.load_model(ModelConfig(base_model=tiny_config["model"]["base_model"]), "fp32")
    backend.attach_adapter(handle, AdapterConfig(type="lora", r=4, alpha=8))
    trainer = backend.create_trainer(handle, load_config(tiny_config).training)
    assert isinstance(trainer.optimizer, HostOffloadOptimizer)


def test_all_memory_features_together_train_exactly(tiny_config, tmp_path):
    tiny_config["adapter"] = {"type": "qlora", "r": 4, "alpha": 8}
    plain = short_run(tiny_config, tmp_path, "plain")
    everything = MemoryConfig(stream_layers=True, activation_offload=True, optimizer_offload=True)
    assert_same_training(plain, short_run(tiny_config, tmp_path, "all", everything))


def test_compact_bf16_storage_trains_like_the_upcast_model(tiny_config, tmp_path, bf16_model_dir):
    """A bf16 checkpoint on an fp32-compute device: compact storage (auto) vs the model upcast in full."""
    compact = short_run(tiny_config, tmp_path, "compact", model_dir=bf16_model_dir)
    assert any(isinstance(m, StoredLinear) for m in compact[0].model.model.modules())
    upcast_cfg = {**tiny_config, "model": {"base_model": str(bf16_model_dir), "dtype": "float32"}}
    upcast = short_run(upcast_cfg, tmp_path, "upcast")
    assert not any(isinstance(m, StoredLinear) for m in upcast[0].model.model.modules())
    assert_same_training(upcast, compact)


def test_stream_layers_with_full_finetuning_is_refused_by_the_config(tiny_config):
    tiny_config["adapter"] = {"type": "none"}
    tiny_config["memory"] = {"stream_layers": True}
    with pytest.raises(MudpuppyError, match="stream_layers"):
        load_config(tiny_config)


@pytest.mark.parametrize("key", ["optimizer_offload", "activation_offload", "stream_layers"])
def test_cpu_backend_refuses_memory_features_before_loading(tiny_config, tmp_path, key):
    tiny_config["memory"] = {key: True}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_config))
    res = CliRunner().invoke(main, ["run", "-c", str(path)])
    assert res.exit_code == 2, res.output
    assert f"memory.{key}" in res.output and "cpu backend" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ running out of memory


def test_out_of_memory_names_what_to_try_and_keeps_the_checkpoint(tiny_config, tmp_path, monkeypatch):
    from mudpuppy.backends.torch.backend import TorchTrainer

    real = TorchTrainer._forward
    calls = [0]

    def step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TorchTrainer, "_forward", step)
    tiny_config["training"].update(max_steps=4, save_steps=1, gradient_checkpointing=False)
    tiny_config["eval"] = {"before_training": False, "after_training": False}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_config))
    res = CliRunner().invoke(main, ["run", "-c", str(path)])
    assert res.exit_code == 4, res.output
    assert "Traceback" not in res.output and "step 3: out of memory on the cpu backend" in res.output
    text = res.output
    # Most likely to help first; offload options are not offered where device memory is host memory.
    assert text.index("gradient_checkpointing") < text.index("micro_batch_size") < text.index("qlora")
    assert "memory.optimizer_offload" not in text
    assert "step-00000002" in text and (tmp_path / "run" / "checkpoints" / "step-00000002").is_dir()


@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_parameter_count_includes_weights_kept_outside_parameters(bf16_model_dir, adapter):
    from transformers import AutoModelForCausalLM

    backend = create_backend("cpu")
    handle = backend.load_model(ModelConfig(base_model=str(bf16_model_dir)), "fp32", adapter=AdapterConfig(type=adapter))
    info = backend.attach_adapter(handle, AdapterConfig(type=adapter, r=4, alpha=8))
    plain = AutoModelForCausalLM.from_pretrained(str(bf16_model_dir))
    assert info.total_params == sum(p.numel() for p in plain.parameters()) + info.trainable_params


def trainer_and_batch(tiny_config, memory: MemoryConfig):
    """The CPU backend with `memory`, the tiny model with the config's adapter, its trainer, one training batch."""
    from mudpuppy.data import Batcher, load_data, prepare_sft_data

    cfg = load_config(tiny_config)
    backend = create_backend("cpu")
    backend.plan.memory = memory
    handle = backend.load_model(cfg.model, "fp32", adapter=cfg.adapter)
    backend.attach_adapter(handle, cfg.adapter)
    trainer = backend.create_trainer(handle, cfg.training)
    data = prepare_sft_data(cfg, handle.tokenizer, load_data(cfg, "sft"))
    return backend, trainer, Batcher.from_config(data.train, cfg, handle.tokenizer.pad_token_id).next_batch()


# 14 quantized layers. Checkpointing: forward, recompute, backward (or, streamed, the recompute's weight
# kept for backward). Without: forward, then backward, except the first layer's q/k/v, whose input (the
# frozen embedding) needs no gradient. Never once per use of the weight beyond that.
@pytest.mark.parametrize("checkpointing,stream,rebuilds", [(True, False, 14 * 3), (True, True, 14 * 2),
                                                           (False, False, 14 + 11)])
def test_qlora_rebuilds_each_weight_a_bounded_number_of_times(tiny_config, monkeypatch, checkpointing, stream,
                                                              rebuilds):
    tiny_config["adapter"] = {"type": "qlora", "r": 4, "alpha": 8}
    tiny_config["training"]["gradient_checkpointing"] = checkpointing
    _, trainer, batch = trainer_and_batch(tiny_config, MemoryConfig(stream_layers=stream))
    calls = [0]
    real = Linear4bit.dequantize

    def counting(self, dtype=None, out=None):
        calls[0] += 1
        return real(self, dtype, out)

    monkeypatch.setattr(Linear4bit, "dequantize", counting)
    monkeypatch.setattr(Linear4bit, "materialize", counting)
    trainer.step([batch], 1e-3)
    assert calls[0] == rebuilds


def test_a_tied_head_upcast_in_row_chunks_matches_the_dense_head():
    from mudpuppy.backends.torch.model.frozen import StoredLinear

    embedding = torch.nn.Embedding(50, 16).to(torch.bfloat16).requires_grad_(False)
    head = StoredLinear.tied_to(embedding, row_chunk=7, weight_dtype=torch.float32)   # 8 chunks, the last short
    x = torch.randn(3, 5, 16, requires_grad=True)
    dense = embedding.weight.float()
    out = head(x)
    torch.testing.assert_close(out, x @ dense.T, rtol=1e-6, atol=1e-5)
    grad = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, x, grad)
    torch.testing.assert_close(got, grad @ dense, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("optimizer_offload", [False, True])
def test_a_released_trainer_frees_its_optimizer_state_and_gradients(tiny_config, monkeypatch, optimizer_offload):
    """After the last checkpoint the optimizer's moments (and offload's master weights) and the last gradients
    are garbage, and a GPU's caching allocator gives their blocks back (issue 28 item 6)."""
    import weakref

    backend, trainer, batch = trainer_and_batch(tiny_config, MemoryConfig(optimizer_offload=optimizer_offload))
    trainer.step([batch], 1e-3)
    state = [t for s in trainer.optimizer.state_dict()["state"].values() for t in s.values()
             if isinstance(t, torch.Tensor) and t.numel() > 1]
    assert state and all(p.grad is not None for p in trainer.params)
    held = [weakref.ref(t) for t in state]
    del state
    emptied = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    backend.plan.device = torch.device("cuda", 0)            # a stand-in: only the release path reads it
    trainer.release()
    assert trainer.optimizer is None and all(p.grad is None for p in trainer.params)
    assert all(ref() is None for ref in held)
    assert emptied == [True]
