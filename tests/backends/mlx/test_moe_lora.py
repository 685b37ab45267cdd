"""LoRA on mixture-of-experts experts on MLX, in PEFT's target_parameters layout (issue 26).

PEFT adapts transformers' fused expert tensors with one rank-r pair per expert on
`experts.gate_up_proj` (gate and up sharing it) and one on `experts.down_proj`. A PEFT adapter
with random weights on every target (attention and experts) loads on the MLX backend with
torch's logits (fp32, 1e-4); saving it back from MLX gives PEFT's tensors bit for bit, and its
mlx-lm copy (LoRASwitchLinear pairs) loads in mlx-lm's own `load_adapters` with the same
logits. `all-linear` on MLX adapts the experts, a step moves them, the router stays frozen.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")
mlx = pytest.importorskip("mlx")
import mlx.nn  # noqa: E402
pytest.importorskip("mlx_lm")

from mudpuppy.backends import adapters as fmt
from mudpuppy.config import AdapterConfig, TrainingConfig
from mudpuppy.errors import MudpuppyError

from ...conftest import randomize_lora
from .conftest import model_cfg
from .test_families import _flat, batch, model_dirs  # noqa: F401 - model_dirs: the fixture

pytestmark = pytest.mark.mlx
FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss"]


def random_peft_adapter(path, out, scale: float = 0.05, experts: bool = True):
    """PEFT's own adapter (attention, and the fused experts unless `experts` is False), every lora weight
    random with std `scale`, saved as PEFT saves it."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                        target_parameters=["experts.gate_up_proj", "experts.down_proj"] if experts else None)
    peft_model = get_peft_model(model, config)
    randomize_lora(peft_model, seed=0, scale=scale, part="lora_")
    peft_model.save_pretrained(str(out))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_a_peft_expert_adapter_gives_torchs_logits_on_mlx_and_converts_back_exactly(
        family, model_dirs, mlx_backend, torch_backend, tmp_path):
    from mlx_lm.tuner.utils import load_adapters

    path = model_dirs(family)
    adapter = random_peft_adapter(path, tmp_path / "peft")
    b = batch()
    real = b.attention_mask.astype(bool)
    t = torch_backend.load_model(model_cfg(path), "fp32")
    base = torch_backend.logits(t, b)
    torch_backend.load_adapter(t, str(adapter))
    expected = torch_backend.logits(t, b)
    assert float(np.abs(expected - base)[real].max()) > 1e-2       # the adapter (experts included) acts

    m = mlx_backend.load_model(model_cfg(path), "fp32")
    mlx_backend.load_adapter(m, str(adapter))
    got = mlx_backend.logits(m, b)
    diff = float(np.abs(got - expected)[real].max())
    assert diff < 1e-4, f"{family}: MLX logits with the PEFT expert adapter {diff:.2e} from torch's"

    # MLX -> PEFT: the same tensors, bit for bit, under PEFT's names.
    mlx_backend.save_adapter(m, str(tmp_path / "back"))
    original, _ = fmt.read_safetensors(adapter / fmt.PEFT_WEIGHTS)
    back, _ = fmt.read_safetensors(tmp_path / "back" / fmt.PEFT_WEIGHTS)
    assert sorted(back) == sorted(original)
    assert all(back[k].equals(original[k]) for k in original)
    assert any(".experts.base_layer.lora_A" in k for k in back)

    # The mlx-lm copy: mlx-lm's own LoRASwitchLinear reads it, with torch's logits.
    mlx_dir = tmp_path / "back" / fmt.MLX_SUBDIR
    keys = json.loads((mlx_dir / fmt.CONFIG_FILE).read_text())["lora_parameters"]["keys"]
    assert any(k.endswith("gate_proj") for k in keys) and any(k.endswith("down_proj") for k in keys)
    m2 = mlx_backend.load_model(model_cfg(path), "fp32")
    load_adapters(m2.model, str(mlx_dir))
    diff = float(np.abs(mlx_backend.logits(m2, b) - expected)[real].max())
    assert diff < 1e-4, f"{family}: mlx-lm's load_adapters of the mlx copy {diff:.2e} from torch's"
    # ... and it converts back to PEFT's fused layout exactly.
    again = fmt.read_adapter(mlx_dir)
    assert all(again.experts[k].lora_a.equals(v.lora_a) and again.experts[k].lora_b.equals(v.lora_b)
               for k, v in fmt.read_adapter(adapter).experts.items())

    # Merged: the experts' deltas folded into the stacks, the same logits.
    mlx_backend.merge_and_save(m, str(tmp_path / "merged"), dtype="float32")
    merged = mlx_backend.load_model(model_cfg(tmp_path / "merged"), "fp32")
    diff = float(np.abs(mlx_backend.logits(merged, b) - expected)[real].max())
    assert diff < 1e-4, f"{family}: merged logits {diff:.2e} from the adapter's"


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_all_linear_on_mlx_adapts_the_experts_and_one_step_moves_them(family, model_dirs, mlx_backend):
    m = mlx_backend.load_model(model_cfg(model_dirs(family)), "fp32")
    info = mlx_backend.attach_adapter(m, AdapterConfig(type="lora", r=4, alpha=8, target_modules="all-linear"))
    assert {"experts.gate_up_proj", "experts.down_proj"} <= set(info.target_modules)
    trainable = dict(_flat(m.model.trainable_parameters()))
    assert not any(k.endswith(("mlp.gate.weight", "mlp.router.weight")) or ".gate.lora" in k or ".router.lora" in k
                   for k in trainable), "the router must stay frozen"
    before = {k: np.array(v) for k, v in trainable.items()}
    trainer = mlx_backend.create_trainer(m, TrainingConfig(max_steps=1, learning_rate=1e-2))
    result = trainer.step([batch()], 1e-2)
    assert np.isfinite(result.loss)
    after = dict(_flat(m.model.trainable_parameters()))
    moved = {k for k, v in before.items() if not np.array_equal(v, np.array(after[k]))}
    for pair in ("gate_up.lora_b", "down.lora_b"):
        assert any(k.endswith(pair) for k in moved), f"{family}: the step left {pair} as it was"


def test_train_router_and_dora_on_experts_are_refused_by_name(model_dirs, mlx_backend):
    m = mlx_backend.load_model(model_cfg(model_dirs("qwen3_moe")), "fp32")
    with pytest.raises(MudpuppyError, match="train_router.*torch backends only"):
        mlx_backend.attach_adapter(m, AdapterConfig(type="lora", r=4, train_router=True))
    with pytest.raises(MudpuppyError, match="without DoRA"):
        mlx_backend.attach_adapter(m, AdapterConfig(type="dora", r=4))


@pytest.mark.parametrize("family,experts", [("qwen3_moe", True), ("mixtral", True), ("gpt_oss", True),
                                            ("gpt_oss", False)])
def test_larger_adapters_still_give_torchs_logits(family, experts, model_dirs, mlx_backend, torch_backend, tmp_path):
    """Adapter weights of std 0.2 (4x the test above) stay within 1e-4 of torch. gpt-oss did not (1.6e-4)
    until the MLX backend gave its YaRN rope transformers' frequencies (families.exact_yarn): sharper
    attention had amplified two wrong rotary frequencies."""
    path = model_dirs(family)
    adapter = random_peft_adapter(path, tmp_path / "peft", scale=0.2, experts=experts)
    b = batch()
    real = b.attention_mask.astype(bool)
    t = torch_backend.load_model(model_cfg(path), "fp32")
    torch_backend.load_adapter(t, str(adapter))
    m = mlx_backend.load_model(model_cfg(path), "fp32")
    mlx_backend.load_adapter(m, str(adapter))
    diff = float(np.abs(mlx_backend.logits(m, b) - torch_backend.logits(t, b))[real].max())
    assert diff < 1e-4, f"{family}: {diff:.2e} from torch's logits"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_router_aux_loss_on_mlx_is_torchs(family, model_dirs, mlx_backend, torch_backend, tmp_path):
    """model.router_aux_loss_coef turns the router's load-balancing loss on for both runtimes: the SFT
    loss, and the term the preference and GRPO forwards return, equal torch's; its gradient reaches
    the adapter; evaluation leaves it out; 0 turns it off."""
    from mudpuppy.backends.mlx import forward
    from mudpuppy.backends.mlx.trainer import TokenLoss
    from mudpuppy.config import ModelConfig

    path = model_dirs(family)
    adapter = random_peft_adapter(path, tmp_path / "peft", experts=True)
    cfg = ModelConfig(base_model=str(path), router_aux_loss_coef=0.5)
    b = batch()
    t = torch_backend.load_model(cfg, "fp32")
    torch_backend.load_adapter(t, str(adapter))
    m = mlx_backend.load_model(cfg, "fp32")
    mlx_backend.load_adapter(m, str(adapter))
    with torch.no_grad():
        expected_loss, n = torch_backend.loss_sum(t, b)
        plain, _ = torch_backend.loss_sum(t, b, router_aux=False)
        _, _, expected_aux = torch_backend.sequence_logprobs(t, b, grad=False, router_aux=True)
    assert float(expected_aux) > 0.1
    got_loss, _ = TokenLoss()(m, b)
    assert float(got_loss.item()) / n == pytest.approx(float(expected_loss) / n, abs=1e-5)
    assert float(forward.loss_sum(m, b).item()) / n == pytest.approx(float(plain) / n, abs=1e-5)
    _, _, aux = mlx_backend.sequence_logprobs(m, b, grad=False, router_aux=True)
    assert float(aux.item()) == pytest.approx(float(expected_aux), abs=1e-5)
    _, _, aux = mlx_backend.token_logprobs(m, b, grad=True, router_aux=True)
    assert float(aux.item()) == pytest.approx(float(expected_aux), abs=1e-5)

    import mlx.nn as nn

    fresh = mlx_backend.load_model(cfg, "fp32")
    mlx_backend.attach_adapter(fresh, AdapterConfig(type="lora", r=4, alpha=8))

    def term(model):
        return mlx_backend.token_logprobs(fresh, b, grad=True, router_aux=True)[2]

    grads = dict(_flat(nn.value_and_grad(fresh.model, term)(fresh.model)[1]))
    assert any(float(mx.abs(g).sum().item()) > 0 for k, g in grads.items() if "lora_b" in k)

    off = mlx_backend.load_model(ModelConfig(base_model=str(path), router_aux_loss_coef=0.0), "fp32")
    assert float(mlx_backend.sequence_logprobs(off, b, grad=False, router_aux=True)[2].item()) == 0.0


def test_router_aux_loss_coef_is_refused_for_a_model_without_a_router(model_dirs, mlx_backend):
    from mudpuppy.config import ModelConfig

    with pytest.raises(MudpuppyError, match="router_aux_loss_coef.*no router"):
        mlx_backend.load_model(ModelConfig(base_model=str(model_dirs("qwen3")), router_aux_loss_coef=0.01), "fp32")


def test_the_handle_says_how_it_loaded(model_dirs, mlx_backend):
    m = mlx_backend.load_model(model_cfg(model_dirs("qwen3_moe")), "fp32")
    assert m.describe() == "loaded through mlx-lm's qwen3_moe at fp32, masked attention, head on loss positions only"


@pytest.mark.parametrize("family", FAMILIES)
def test_qlora_on_mlx_quantizes_the_experts_and_trains_their_adapter(family, model_dirs, mlx_backend):
    """QLoRA's 4-bit base includes the expert stacks (mlx-lm's QuantizedSwitchLinear), most of an MoE
    model's weights; the routers stay full precision, as on torch; all-linear adapts the quantized
    experts and one step moves their pairs."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    cfg = AdapterConfig(type="qlora", r=4, alpha=8)
    m = mlx_backend.load_model(model_cfg(model_dirs(family)), "fp32", adapter=cfg)
    info = mlx_backend.attach_adapter(m, cfg)
    modules = dict(m.model.named_modules())
    stacks = [mod for mod in modules.values() if isinstance(mod, (SwitchLinear, QuantizedSwitchLinear))]
    # The tiny models' down stacks read 32 columns, under a group of 64: those stay full precision, reported.
    assert any(isinstance(mod, QuantizedSwitchLinear) for mod in stacks)
    assert all(isinstance(mod, QuantizedSwitchLinear) == (mod.input_dims % 64 == 0) for mod in stacks)
    assert sum(".experts." in p or "switch_mlp" in p for p in m.quantization["kept_full_precision"]) == sum(
        isinstance(mod, SwitchLinear) for mod in stacks)
    from mudpuppy.backends.mlx.experts import router_paths

    assert all(isinstance(modules[p], mlx.nn.Linear) for p in router_paths(m.model))
    assert {"experts.gate_up_proj", "experts.down_proj"} <= set(info.target_modules)
    before = {k: np.array(v) for k, v in _flat(m.model.trainable_parameters()) if "lora_b" in k}
    trainer = mlx_backend.create_trainer(m, TrainingConfig(max_steps=1, learning_rate=1e-2))
    assert np.isfinite(trainer.step([batch()], 1e-2).loss)
    after = dict(_flat(m.model.trainable_parameters()))
    assert any(("gate_up" in k or k.endswith("down.lora_b")) and not np.array_equal(v, np.array(after[k]))
               for k, v in before.items())
