"""adapter.init on torch: PEFT's PiSSA / OLoRA factors equal the runtime-neutral ones, the function is
preserved at step 0, and the saved adapter is a plain LoRA on the original base (merge, plain PEFT)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from mudpuppy import create_backend, load_config
from mudpuppy.backends.adapters.init import initial_factors
from mudpuppy.config import AdapterConfig, ModelConfig

from .mlx.conftest import random_batch


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.wide = torch.nn.Linear(16, 24, bias=False)
        self.tall = torch.nn.Linear(40, 16, bias=False)
        for layer in (self.wide, self.tall):
            layer.weight.data = 0.2 * torch.randn(layer.weight.shape, generator=gen)   # the tiny model's scale

    def forward(self, x):
        return self.tall(torch.cat([self.wide(x), x], dim=-1))


@pytest.mark.parametrize("init", ["pissa", "olora"])
@pytest.mark.parametrize("rslora", [False, True])
def test_neutral_factors_equal_peft_own(init, rslora):
    """A, B and the residual base that PEFT computes equal adapters/init.py's, component signs made
    canonical (a singular vector's sign is LAPACK's choice)."""
    from peft import LoraConfig, get_peft_model

    from mudpuppy.backends.adapters.init import canonical_signs

    model = TwoLinears()
    original = {n: m.weight.detach().clone().numpy() for n, m in model.named_children()}
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["wide", "tall"],
                                                  use_rslora=rslora, init_lora_weights=init))
    scale = 8 / (2 if rslora else 4)
    for name in ("wide", "tall"):
        layer = getattr(peft_model.base_model.model, name)
        a, b = canonical_signs(layer.lora_A["default"].weight.detach().numpy(),
                               layer.lora_B["default"].weight.detach().numpy())
        ours_a, ours_b, residual = initial_factors(init, original[name], 4, scale)
        np.testing.assert_allclose(a, ours_a, atol=1e-5)
        np.testing.assert_allclose(b, ours_b, atol=1e-5)
        np.testing.assert_allclose(layer.base_layer.weight.detach().numpy(), residual, atol=1e-5)


def test_randomized_svd_finds_the_top_singular_space():
    """pissa_niter_N on MLX: torch.svd_lowrank's algorithm in numpy, on a weight with a clear top-4 space."""
    rng = np.random.default_rng(1)
    u, v = np.linalg.qr(rng.standard_normal((24, 4)))[0], np.linalg.qr(rng.standard_normal((16, 4)))[0]
    w = (u @ np.diag([4.0, 3.0, 2.0, 1.5]) @ v.T + 1e-3 * rng.standard_normal((24, 16))).astype(np.float32)
    a, b, _ = initial_factors("pissa_niter_8", w, 4, 2.0)
    exact_a, exact_b, _ = initial_factors("pissa", w, 4, 2.0)
    np.testing.assert_allclose(b @ a, exact_b @ exact_a, atol=1e-4)


def attached(model_dir, init):
    backend = create_backend("cpu")
    handle = backend.load_model(ModelConfig(base_model=str(model_dir)), "fp32")
    backend.attach_adapter(handle, AdapterConfig(type="lora", r=4, alpha=8, init=init))
    return backend, handle


@pytest.mark.parametrize("init", ["pissa", "olora", "pissa_niter_4"])
def test_attached_init_keeps_the_base_function_and_the_neutral_factors(tiny_model_dir, init):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    backend, handle = attached(tiny_model_dir, init)
    batch = random_batch(len(handle.tokenizer))
    with torch.no_grad():
        expected = base(input_ids=torch.as_tensor(batch.input_ids),
                        attention_mask=torch.as_tensor(batch.attention_mask)).logits.numpy()
    np.testing.assert_allclose(backend.logits(handle, batch), expected, atol=1e-5)
    original = dict(base.named_parameters())
    q = handle.model.base_model.model.model.layers[1].self_attn.q_proj
    a, b = q.lora_A["default"].weight.detach().numpy(), q.lora_B["default"].weight.detach().numpy()
    assert np.abs(b).max() > 0.01, "the adapter starts from the weight's factors, not from zero"
    if init != "pissa_niter_4":     # the randomized SVD draws from torch's generator on torch
        ours_a, ours_b, _ = initial_factors(init, original["model.layers.1.self_attn.q_proj.weight"].detach(), 4, 2.0)
        np.testing.assert_allclose(a, ours_a, atol=1e-5)
        np.testing.assert_allclose(b, ours_b, atol=1e-5)


@pytest.mark.parametrize("init", ["pissa", "olora", "pissa_niter_4", "gaussian"])
def test_trained_adapter_saves_as_a_plain_lora_on_the_original_base(tiny_config, tmp_path, init):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mudpuppy.data import Batcher, load_data, prepare_sft_data

    tiny_config["adapter"]["init"] = init
    cfg = load_config(tiny_config)
    backend = create_backend("cpu")
    handle = backend.load_model(cfg.model, "fp32", adapter=cfg.adapter)
    backend.attach_adapter(handle, cfg.adapter)
    trainer = backend.create_trainer(handle, cfg.training)
    data = prepare_sft_data(cfg, handle.tokenizer, load_data(cfg, "sft"))
    batcher = Batcher.from_config(data.train, cfg, handle.tokenizer.pad_token_id)
    for _ in range(3):
        trainer.step([batcher.next_batch()], 5e-3)
    # What the trained model computes: its residual base plus the trained adapter, merged.
    trained = {name: layer.get_delta_weight("default").detach() + layer.base_layer.weight.detach()
               for name, layer in handle.model.base_model.model.named_modules() if hasattr(layer, "lora_A")}
    batch = random_batch(len(handle.tokenizer))
    trained_logits = backend.logits(handle, batch)
    backend.save_adapter(handle, str(tmp_path / "adapter"))

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir_of(tiny_config)), dtype=torch.float32)
    plain = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    # The residual's inits save a plain rank-2r LoRA; gaussian keeps r (and names itself: loading ignores it).
    rank, recorded = (4, "gaussian") if init == "gaussian" else (8, True)
    assert plain.peft_config["default"].r == rank and plain.peft_config["default"].init_lora_weights == recorded
    with torch.no_grad():
        logits = plain(input_ids=torch.as_tensor(batch.input_ids),
                       attention_mask=torch.as_tensor(batch.attention_mask)).logits.numpy()
    np.testing.assert_allclose(logits, trained_logits, atol=1e-5)
    original = base.get_submodule("model.layers.0.mlp.down_proj").weight.detach().clone()
    merged = dict(plain.merge_and_unload().named_modules())
    # Training moved the weights: the merge below is not of an untrained adapter.
    assert (trained["model.layers.0.mlp.down_proj"] - original).abs().max() > 1e-3
    for name, weight in trained.items():
        np.testing.assert_allclose(merged[name].weight.detach().numpy(), weight.numpy(), atol=1e-5)


def tiny_model_dir_of(cfg: dict) -> str:
    return cfg["model"]["base_model"]


@pytest.mark.parametrize("init", ["kaiming", "pissa_niter_", "pissa_niter_0", "PiSSA", "LoftQ"])
def test_unknown_initialisations_are_refused_with_their_key_path(tiny_config, init):
    tiny_config["adapter"]["init"] = init
    with pytest.raises(Exception, match=r"adapter\.init") as info:
        load_config(tiny_config)
    assert "pissa_niter_N" in str(info.value)


@pytest.mark.parametrize("kind", ["dora", "qlora"])
def test_pissa_needs_a_plain_lora(kind):
    with pytest.raises(ValidationError, match="use lora"):
        AdapterConfig(type=kind, init="pissa")
    assert AdapterConfig(type=kind, init="gaussian").init == "gaussian"


def test_pissa_on_a_bf16_checkpoint_kept_compact_starts_from_its_function(tiny_model_dir, tmp_path):
    """On a CPU a bf16 checkpoint under an adapter stays bf16 (model/frozen.py's compact layers); PiSSA's targets
    become fp32 parameters holding the residual, and the model still computes what it computed."""
    from transformers import AutoModelForCausalLM

    from mudpuppy.backends.torch.model.frozen import FrozenLinear

    bf16 = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16)
    bf16.save_pretrained(tmp_path / "bf16")
    for path in tiny_model_dir.iterdir():
        if not (tmp_path / "bf16" / path.name).exists():
            (tmp_path / "bf16" / path.name).write_bytes(path.read_bytes())
    backend = create_backend("cpu")
    cfg = AdapterConfig(type="lora", r=4, alpha=8, init="pissa")
    reference = backend.load_model(ModelConfig(base_model=str(tmp_path / "bf16")), "fp32", adapter=cfg)
    assert any(isinstance(m, FrozenLinear) for m in reference.model.modules()), "the compact path is taken"
    batch = random_batch(len(reference.tokenizer))
    expected = backend.logits(reference, batch)
    handle = backend.load_model(ModelConfig(base_model=str(tmp_path / "bf16")), "fp32", adapter=cfg)
    backend.attach_adapter(handle, cfg)
    q = handle.model.base_model.model.model.layers[0].self_attn.q_proj
    assert q.base_layer.weight.dtype == torch.float32 and not q.base_layer.weight.requires_grad
    np.testing.assert_allclose(backend.logits(handle, batch), expected, atol=1e-5)


@pytest.mark.parametrize("method,section,key", [("preference", {"preference": {"type": "dpo"}}, "preference"),
                                                ("grpo", {"grpo": {"reward_funcs": ["exact_match"], "beta": 0.04}},
                                                 "grpo.beta")])
def test_pissa_is_refused_where_the_reference_is_the_base_with_the_adapter_off(tiny_config, method, section, key):
    """With the adapter off, a PiSSA model is the residual, not the base: no reference can be taken so."""
    tiny_config.update(method=method, adapter={**tiny_config["adapter"], "init": "pissa"}, **section)
    with pytest.raises(Exception, match=f"{key}.*residual"):
        load_config(tiny_config)
    tiny_config["adapter"]["init"] = "gaussian"
    if method == "preference":
        load_config(tiny_config)


def test_cli_pissa_run_merges_and_resumes_exactly(tiny_config, tmp_path):
    """The real CLI: a PiSSA run's merged model is the base plus its saved plain LoRA, and a run resumed
    from its step-3 checkpoint (which attaches PiSSA again, then loads the trained factors) ends on the same
    adapter, bit for bit."""
    import shutil

    import yaml
    from click.testing import CliRunner
    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from mudpuppy.cli import main

    tiny_config["adapter"]["init"] = "pissa"
    tiny_config["merge"] = True
    tiny_config["training"]["save_steps"] = 3
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(tiny_config))
    res = CliRunner().invoke(main, ["run", "--config", str(tmp_path / "cfg.yaml")])
    assert res.exit_code == 0, res.output
    out = tmp_path / "run"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir_of(tiny_config), dtype=torch.float32)
    expected = PeftModel.from_pretrained(base, str(out)).merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(str(out / "merged"), dtype=torch.float32).state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        torch.testing.assert_close(merged[name], expected[name].to(torch.bfloat16).float(), rtol=0, atol=0)

    again = tmp_path / "again"
    shutil.copytree(out / "checkpoints", again / "checkpoints")
    shutil.copy(out / ".mudpuppy-run.json", again / ".mudpuppy-run.json")
    shutil.rmtree(again / "checkpoints" / "step-00000006")
    tiny_config.update(output_dir=str(again), merge=False)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(tiny_config))
    res = CliRunner().invoke(main, ["run", "--config", str(tmp_path / "cfg.yaml"), "--resume"])
    assert res.exit_code == 0 and "resumed from" in res.output, res.output
    first, second = load_file(str(out / "adapter_model.safetensors")), load_file(str(again / "adapter_model.safetensors"))
    assert set(first) == set(second)
    for key in first:
        np.testing.assert_array_equal(first[key], second[key])


def test_pissa_on_fused_experts_is_refused_and_attention_only_keeps_the_function(tmp_path):
    from mudpuppy.errors import MudpuppyError

    from ..conftest import build_tokenizer
    from .test_moe import FAMILIES, build

    family = next(iter(FAMILIES))
    build(family).save_pretrained(tmp_path / "moe")
    build_tokenizer(tmp_path / "moe")
    backend = create_backend("cpu")
    cfg = AdapterConfig(type="lora", r=4, alpha=8, init="olora")
    handle = backend.load_model(ModelConfig(base_model=str(tmp_path / "moe")), "fp32", adapter=cfg)
    with pytest.raises(MudpuppyError, match=r"adapter.init olora: .*fused tensors .*experts"):
        backend.attach_adapter(handle, cfg)
    cfg = AdapterConfig(type="lora", r=4, alpha=8, init="olora", target_modules=["q_proj", "o_proj"])
    plain = backend.load_model(ModelConfig(base_model=str(tmp_path / "moe")), "fp32", adapter=cfg)
    handle = backend.load_model(ModelConfig(base_model=str(tmp_path / "moe")), "fp32", adapter=cfg)
    backend.attach_adapter(handle, cfg)
    batch = random_batch(len(handle.tokenizer))
    np.testing.assert_allclose(backend.logits(handle, batch), backend.logits(plain, batch), atol=1e-5)
