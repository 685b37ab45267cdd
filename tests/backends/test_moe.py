"""Mixture-of-experts on the torch backends (issue 26, part 3).

Tiny random Qwen3-MoE, Mixtral and gpt-oss (hidden 64, 2 layers, 4 experts, top-2), whose
experts transformers 5 holds as fused 3-D tensors: `all-linear` reaches them through PEFT's
target_parameters, the router stays frozen unless asked, the router's load-balancing loss is
the model's own, QLoRA keeps them in 4 bits, and merging folds the expert LoRA into them.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import transformers

from mudpuppy import create_backend
from mudpuppy.backends.torch.model.attention import choose_attention
from mudpuppy.backends.torch.backend import TorchModel
from mudpuppy.backends.torch.model.experts import PackedExperts, set_router_aux_loss
from mudpuppy.backends.torch.quantization.linear4bit import dequantize_model
from mudpuppy.config import AdapterConfig, ModelConfig
from mudpuppy.data import collate
from mudpuppy.errors import MudpuppyError
from tests.conftest import build_tokenizer
from tests.conftest import random_examples, randomize_lora

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
              pad_token_id=0, bos_token_id=0, eos_token_id=2, num_experts_per_tok=2, router_aux_loss_coef=0.5)
FAMILIES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(num_experts=4, moe_intermediate_size=32)),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4)),
    # YaRN's original length is 4096: the default positions keep transformers from warning about the factor.
    "gpt_oss": (transformers.GptOssConfig, dict(num_local_experts=4, max_position_embeddings=131072, sliding_window=8,
                                                layer_types=["sliding_attention", "full_attention"])),
}
EXPERTS = ["experts.down_proj", "experts.gate_up_proj"]


def build(family: str, seed: int = 0, **extra):
    config_class, own = FAMILIES[family]
    config = config_class(**{**COMMON, **own, **extra})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=choose_attention("AutoModelForCausalLM", config)).eval()


@pytest.fixture(scope="module")
def backend():
    return create_backend("cpu", precision="fp32")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Each family saved as a checkpoint with the local tokenizer (Qwen3-MoE and Mixtral save their experts
    one by one, as on the hub; gpt-oss saves them fused): all three load tensor by tensor."""
    root = tmp_path_factory.mktemp("moe")
    tokenizer = build_tokenizer(root / "tokenizer")
    dirs = {}
    for family in FAMILIES:
        dirs[family] = root / family
        build(family).save_pretrained(dirs[family])
        tokenizer.save_pretrained(dirs[family])
    return dirs


def load(backend, model_dirs, family: str, **adapter):
    cfg = AdapterConfig(**{"r": 4, "alpha": 8, **adapter})
    handle = backend.load_model(ModelConfig(base_model=str(model_dirs[family])), precision="fp32", adapter=cfg)
    return handle, backend.attach_adapter(handle, cfg)


def examples(lengths, seed=0):
    return random_examples(lengths, VOCAB, seed)


def batch_of(lengths=(14, 9, 11), seed=0):
    return collate(examples(lengths, seed), pad_id=0)




def expert_lora(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if "experts" in n and "lora_" in n}


# ------------------------------------------------------------------ adapters reach the experts


@pytest.mark.parametrize("family", list(FAMILIES))
def test_all_linear_adapts_the_experts_and_they_learn(backend, model_dirs, family):
    handle, info = load(backend, model_dirs, family)
    assert set(EXPERTS) <= set(info.target_modules)
    assert info.groups["experts"]["adapted"] == info.groups["experts"]["params"] > info.groups["attention"]["params"]
    assert info.groups["router"]["adapted"] == 0                          # frozen by default
    routers = [p for n, p in handle.model.named_parameters() if ".mlp.gate." in n or ".mlp.router." in n]
    assert routers and not any(p.requires_grad for p in routers)
    assert "experts" in info.describe_groups() and "router" in info.describe_groups()
    lora = expert_lora(handle.model)
    assert len(lora) == 2 * 2 * 2 and all(p.requires_grad for p in lora.values())   # 2 layers x 2 tensors x A, B
    trainer = backend.create_trainer(handle, _training())
    before = {n: p.detach().clone() for n, p in lora.items()}
    trainer.step([batch_of()], lr=1e-2)
    grads = {n: p.grad for n, p in lora.items()}
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)
    trainer.step([batch_of(seed=1)], lr=1e-2)
    assert all(not torch.equal(before[n], p) for n, p in lora.items())   # A moves once B has


def test_the_router_trains_when_asked(backend, model_dirs):
    handle, info = load(backend, model_dirs, "gpt_oss", train_router=True)
    assert info.groups["router"]["adapted"] == info.groups["router"]["params"]
    trained = {n: p for n, p in handle.model.named_parameters() if "router" in n and p.requires_grad}
    assert trained and all("modules_to_save" in n for n in trained)
    trainer = backend.create_trainer(handle, _training())
    trainer.step([batch_of()], lr=1e-2)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained.values())


def test_attention_only_on_experts_warns_in_one_line(backend, model_dirs, caplog):
    with caplog.at_level(logging.WARNING):
        _, info = load(backend, model_dirs, "mixtral", target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "adapter:" in r.getMessage()]
    assert len(lines) == 1 and "experts" in lines[0] and "\n" not in lines[0]
    assert info.groups["experts"]["adapted"] == 0
    with pytest.raises(MudpuppyError, match="dropout"):
        load(backend, model_dirs, "mixtral", dropout=0.1)
    _, named = load(backend, model_dirs, "mixtral", target_modules=["q_proj", "experts.down_proj"])
    assert named.target_modules == ["q_proj", "experts.down_proj"]


# ------------------------------------------------------------------ the router's auxiliary loss


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_training_loss_is_the_models_own_with_the_router_aux_loss(backend, family):
    model = build(family, output_router_logits=True)
    handle = TorchModel(model, None, family)
    batch = batch_of()
    labels = torch.as_tensor(batch.labels)
    assert (labels[:, -1] == -100).all()
    shifted = torch.full_like(labels, -100)
    shifted[:, 1:] = labels[:, :-1]          # transformers shifts its labels itself
    with torch.no_grad():
        theirs = model(input_ids=torch.as_tensor(batch.input_ids), attention_mask=torch.as_tensor(batch.attention_mask),
                       labels=shifted)
        total, n = backend.loss_sum(handle, batch)
        plain, _ = backend.loss_sum(handle, batch, router_aux=False)
    assert float(total) / n == pytest.approx(float(theirs.loss), abs=1e-5, rel=1e-5)
    assert float(total - plain) / n == pytest.approx(0.5 * float(theirs.aux_loss), rel=1e-5)
    assert float(total - plain) / n > 0.1                 # the term is really there


def aux_handle(backend, model_dirs, family, coef):
    cfg = AdapterConfig(r=4, alpha=8)
    handle = backend.load_model(ModelConfig(base_model=str(model_dirs[family]), router_aux_loss_coef=coef),
                                precision="fp32", adapter=cfg)
    backend.attach_adapter(handle, cfg)
    randomize_lora(handle.model)
    return handle


def their_aux_loss(handle, batch) -> float:
    """The weighted term the model's own forward (PEFT's wrapper over it) adds to its loss."""
    with torch.no_grad():
        out = handle.model(input_ids=torch.as_tensor(batch.input_ids), attention_mask=torch.as_tensor(batch.attention_mask),
                           output_router_logits=True)
    return 0.5 * float(out.aux_loss)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_log_prob_forwards_carry_the_models_router_aux_loss(backend, model_dirs, family):
    """What DPO/IPO/SimPO/ORPO/KTO (sequence_logprobs) and GRPO (token_logprobs) add, as TRL adds it."""
    handle = aux_handle(backend, model_dirs, family, 0.5)
    batch = batch_of()
    expected = their_aux_loss(handle, batch)
    assert expected > 0.1
    plain = backend.sequence_logprobs(handle, batch, grad=False)
    logps, counts, aux = backend.sequence_logprobs(handle, batch, grad=False, router_aux=True)
    assert float(aux) == pytest.approx(expected, rel=1e-5)
    assert torch.equal(logps, plain[0]) and (counts == plain[1]).all()
    logps, _, aux = backend.token_logprobs(handle, batch, grad=True, router_aux=True)
    assert float(aux.detach()) == pytest.approx(expected, rel=1e-5)
    (logps.sum() + aux).backward()        # the term carries gradient to the adapter
    assert any(p.grad is not None for p in expert_lora(handle.model).values())


def test_router_aux_loss_coef_turns_the_term_on_and_off_and_is_refused_without_a_router(backend, model_dirs,
                                                                                        tiny_model_dir):
    batch = batch_of()
    off = aux_handle(backend, model_dirs, "mixtral", 0.0)
    assert float(backend.sequence_logprobs(off, batch, grad=False, router_aux=True)[2]) == 0.0
    default = aux_handle(backend, model_dirs, "mixtral", None)      # the saved config leaves it off
    assert float(backend.sequence_logprobs(default, batch, grad=False, router_aux=True)[2]) == 0.0
    with torch.no_grad():
        total, n = backend.loss_sum(default, batch)
        plain, _ = backend.loss_sum(default, batch, router_aux=False)
    assert float(total) == float(plain)
    with pytest.raises(MudpuppyError, match="router_aux_loss_coef.*no router"):
        backend.load_model(ModelConfig(base_model=str(tiny_model_dir), router_aux_loss_coef=0.01), precision="fp32")


def test_the_preference_objective_adds_the_term_once_per_pair(backend, model_dirs):
    from mudpuppy.config import PreferenceConfig
    from mudpuppy.data.pairs import Item, collate_items
    from mudpuppy.training.preference import PreferenceObjective

    handle = aux_handle(backend, model_dirs, "qwen3_moe", 0.5)
    exs = examples((9, 12, 10, 7))
    pairs = collate_items([Item((exs[0], exs[1])), Item((exs[2], exs[3]))], pad_id=0)
    objective = PreferenceObjective(backend, PreferenceConfig(type="simpo"))
    total, metrics = objective(handle, pairs, grad=False)
    logps, _, aux = backend.sequence_logprobs(handle, pairs.batch, grad=False, router_aux=True)
    assert metrics["router_aux_loss"] == pytest.approx(float(aux), rel=1e-6)
    set_router_aux_loss(handle.model.get_base_model(), 0.0)        # the same weights without the term
    total_off, metrics_off = objective(handle, pairs, grad=False)
    assert "router_aux_loss" not in metrics_off
    assert float(total - total_off) == pytest.approx(float(aux) * pairs.size, rel=1e-5)


# ------------------------------------------------------------------ QLoRA


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_experts_stored_one_by_one_stream_into_the_fused_stacks(backend, model_dirs, family):
    """The hub's Qwen3-MoE and Mixtral checkpoints hold each expert as its own linears (Mixtral under
    block_sparse_moe, w1/w3/w2): they stream tensor by tensor, one fused stack at a time (QLoRA quantizes
    each as it is built), to exactly the weights transformers' own loader builds."""
    from safetensors import safe_open

    path = model_dirs[family]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert any(".experts.0." in n for n in names) and not any(n.endswith("experts.gate_up_proj") for n in names)
    handle = backend.load_model(ModelConfig(base_model=str(path)), precision="fp32")
    assert handle.load_report.path == "streamed"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()
    mine = handle.model.state_dict()
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    quantized, _ = load(backend, model_dirs, family, type="qlora")
    assert quantized.load_report.path == "streamed"
    assert sum(isinstance(p, PackedExperts) for p in quantized.model.parameters()) == 4


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_qlora_keeps_experts_in_four_bits_and_trains_them(backend, model_dirs, family, tmp_path):
    handle, info = load(backend, model_dirs, family, type="qlora")
    stacks = [p for p in handle.model.parameters() if isinstance(p, PackedExperts)]
    assert len(stacks) == 4 and "expert tensors" in info.quantization
    held = sum(p.quantized_bytes() for p in stacks)
    dense = sum(p.numel() * 4 for p in stacks)           # what fp32 stacks would hold
    assert held / dense < 0.15                           # 4 bits a value plus a bf16 scale and min per 64
    randomize_lora(handle.model)
    batch = batch_of()
    with torch.no_grad():
        quantized_loss, _ = backend.loss_sum(handle, batch)
    quantized_logits = backend.logits(handle, batch)
    trainer = backend.create_trainer(handle, _training())
    trainer.step([batch], lr=0.0)                        # gradients only: the weights stay as they are
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in expert_lora(handle.model).values())
    # The loss QLoRA trains on is the dequantized model's, and the merge folds into exactly those weights.
    assert dequantize_model(handle.model) > len(stacks)                # the 4-bit linears and the stacks
    assert not any(isinstance(p, PackedExperts) for p in handle.model.parameters())
    with torch.no_grad():
        dense_loss, _ = backend.loss_sum(handle, batch)
    assert float(dense_loss) == pytest.approx(float(quantized_loss), rel=1e-5)
    backend.merge_and_save(handle, str(tmp_path / "merged"), dtype="float32")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    np.testing.assert_allclose(_logits(merged, batch), quantized_logits, atol=1e-5)


# ------------------------------------------------------------------ merge and reload


@pytest.mark.parametrize("family", list(FAMILIES))
def test_merged_and_reloaded_logits_equal_the_adapters(backend, model_dirs, family, tmp_path):
    from peft import PeftModel

    handle, _ = load(backend, model_dirs, family, train_router=family == "qwen3_moe")
    randomize_lora(handle.model)
    batch = batch_of()
    adapted = backend.logits(handle, batch)
    backend.save_adapter(handle, str(tmp_path / "adapter"))
    attention = handle.model.config._attn_implementation
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[family], dtype=torch.float32,
                                                             attn_implementation=attention)
    assert np.abs(_logits(base, batch) - adapted).max() > 1e-3          # the adapter does change the logits
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    np.testing.assert_allclose(_logits(reloaded, batch), adapted, atol=1e-5)
    backend.merge_and_save(handle, str(tmp_path / "merged"), dtype="float32")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                               attn_implementation=attention)
    np.testing.assert_allclose(_logits(merged, batch), adapted, atol=1e-5)


def _logits(model, batch) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(batch.input_ids),
                     attention_mask=torch.as_tensor(batch.attention_mask)).logits.float().numpy()


def _training():
    from mudpuppy.config import TrainingConfig

    return TrainingConfig(max_steps=2, micro_batch_size=3, learning_rate=1e-2, precision="fp32",
                          gradient_checkpointing=False)


def test_dora_or_dropout_on_fused_experts_is_refused_before_loading(model_dirs, tiny_config):
    """load_config reads the base's config.json: the refusal names the family, before any weight loads."""
    from mudpuppy import load_config
    from mudpuppy.errors import ConfigError

    tiny_config["model"]["base_model"] = str(model_dirs["mixtral"])
    tiny_config["adapter"].update(type="dora")
    with pytest.raises(ConfigError, match=r"adapter.type: mixtral holds its 4 experts as fused tensors"):
        load_config(tiny_config)
    tiny_config["adapter"].update(type="lora", dropout=0.1)
    with pytest.raises(ConfigError, match=r"adapter.dropout: mixtral .* without dropout"):
        load_config(tiny_config)
    tiny_config["adapter"].update(target_modules=["q_proj", "v_proj"])      # experts not targeted: fine
    assert load_config(tiny_config).adapter.dropout == 0.1
