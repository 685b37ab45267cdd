"""Every family trains on the loss its own forward defines, and packs exactly (issue 26, parts 1 and 2).

Tiny random models (hidden 64, 2 layers, vocab 320) of each family, fp32, with the
embeddings (tied to the head) scaled by 40 so that logit soft-capping and scaling
really act: random tiny models have logits too small to show either. Each check
compares mudpuppy's chunked head against the model's own forward (`model(...).logits`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from mudpuppy import create_backend
from mudpuppy.backends.torch.model.attention import choose_attention, decoder_masks, packing_mask
from mudpuppy.backends.torch.backend import TorchModel
from mudpuppy.backends.torch.model.heads import OutputHead, head_inputs, output_head
from mudpuppy.data import collate, collate_packed
from mudpuppy.errors import MudpuppyError
from ..conftest import random_examples

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
WINDOW = 6          # smaller than the examples below

FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "gemma2": (transformers.Gemma2Config, dict(final_logit_softcapping=5.0, sliding_window=WINDOW,
                                               layer_types=["sliding_attention", "full_attention"])),
    "gemma3_text": (transformers.Gemma3TextConfig, dict(final_logit_softcapping=5.0, sliding_window=WINDOW,
                                                        layer_types=["sliding_attention", "full_attention"])),
    "granite": (transformers.GraniteConfig, dict(logits_scaling=8.0)),
    "cohere": (transformers.CohereConfig, dict(logit_scale=0.0625)),
    "cohere2": (transformers.Cohere2Config, dict(logit_scale=0.0625, sliding_window=WINDOW,
                                                 layer_types=["sliding_attention", "full_attention"])),
    "mistral": (transformers.MistralConfig, dict(sliding_window=WINDOW)),
    "qwen2": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    # YaRN's original length is 4096: the default positions keep transformers from warning about the factor.
    "gpt_oss": (transformers.GptOssConfig, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                                max_position_embeddings=131072,
                                                layer_types=["sliding_attention", "full_attention"])),
}
# What each family's forward applies after the head, as read from it.
EXPECTED_OPS = {
    "llama": (), "mistral": (), "qwen2": (), "gpt_oss": (),
    "gemma2": (("div", 5.0), ("tanh", None), ("mul", 5.0)),
    "gemma3_text": (("div", 5.0), ("tanh", None), ("mul", 5.0)),
    "granite": (("div", 8.0),),
    "cohere": (("mul", 0.0625),), "cohere2": (("mul", 0.0625),),
}
SLIDING = ("gemma2", "gemma3_text", "cohere2", "mistral", "qwen2", "gpt_oss")


def build(family: str, seed: int = 0):
    config_class, extra = FAMILIES[family]
    config = config_class(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=choose_attention("AutoModelForCausalLM", config))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(40.0)     # tied: the head's logits grow too
    return model.eval()


@pytest.fixture(scope="module")
def backend():
    return create_backend("cpu", precision="fp32")


@pytest.fixture(scope="module")
def models():
    return {}


def handle_for(models, family: str) -> TorchModel:
    if family not in models:
        models[family] = TorchModel(build(family), None, family)
    return models[family]


def examples(lengths, seed=0):
    return random_examples(lengths, VOCAB, seed)


def own_logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(batch.input_ids),
                     attention_mask=torch.as_tensor(batch.attention_mask)).logits.float()


# ------------------------------------------------------------------ part 1: the head


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_and_logprobs_equal_the_models_own_forward(backend, models, family):
    handle = handle_for(models, family)
    assert output_head(handle.model).ops == EXPECTED_OPS[family]
    batch = collate(examples([14, 9, 11]), pad_id=0)
    logits = own_logits(handle.model, batch)
    labels = torch.as_tensor(batch.labels)
    keep = labels != -100
    logp = logits.log_softmax(-1)[keep].gather(-1, labels[keep][:, None])[:, 0]
    with torch.no_grad():
        loss, n = backend.loss_sum(handle, batch)
        sums, counts = backend.sequence_logprobs(handle, batch, grad=False)
        tokens, _ = backend.token_logprobs(handle, batch, grad=False)
        hot, _ = backend.token_logprobs(handle, batch, grad=False, temperature=0.7)
    assert n == int(keep.sum())
    assert float(loss) == pytest.approx(float(-logp.sum()), rel=1e-5)
    torch.testing.assert_close(tokens, logp, atol=1e-5, rtol=1e-5)
    rows = keep.nonzero()[:, 0]
    torch.testing.assert_close(sums, torch.zeros(3).index_add(0, rows, logp), atol=1e-4, rtol=1e-5)
    assert list(counts) == keep.sum(1).tolist()
    warm = (logits / 0.7).log_softmax(-1)[keep].gather(-1, labels[keep][:, None])[:, 0]
    torch.testing.assert_close(hot, warm, atol=1e-5, rtol=1e-5)


def test_scaled_weights_make_capping_and_scaling_act(models):
    """Without the post-head operations the logits would differ: the tests above can see a skipped one."""
    for family in ("gemma2", "granite", "cohere"):
        model = handle_for(models, family).model
        batch = collate(examples([10]), pad_id=0)
        with torch.no_grad():
            hidden = model.get_decoder()(input_ids=torch.as_tensor(batch.input_ids)).last_hidden_state
            bare = model.get_output_embeddings()(hidden)
        assert (bare - own_logits(model, batch)).abs().max() > 1.0, family


def test_gradient_flows_through_the_models_own_head(backend, models):
    """The GRPO path (token log-probs with gradient, chunks checkpointed) differentiates the capped logits."""
    handle = handle_for(models, "gemma2")
    batch = collate(examples([12, 8]), pad_id=0)
    params = [p for p in handle.model.parameters()]
    values, _ = backend.token_logprobs(handle, batch, grad=True)
    mine = torch.autograd.grad(values.sum(), params[:3])
    logits = handle.model(input_ids=torch.as_tensor(batch.input_ids),
                          attention_mask=torch.as_tensor(batch.attention_mask)).logits.float()
    labels = torch.as_tensor(batch.labels)
    keep = labels != -100
    theirs = torch.autograd.grad(logits.log_softmax(-1)[keep].gather(-1, labels[keep][:, None]).sum(), params[:3])
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


class OddHeadLlama(transformers.LlamaForCausalLM):
    """A family whose forward reworks the head's output in a way the head reader does not know."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        hidden_states = outputs.last_hidden_state
        hidden_states = transformers.modeling_utils.slice_logits_to_keep(hidden_states, logits_to_keep)
        logits = self.lm_head(hidden_states)
        logits = 20.0 * torch.sigmoid(logits / 20.0)
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits)


def test_an_unknown_post_head_falls_back_to_the_full_forward(backend):
    config = transformers.LlamaConfig(**COMMON)
    torch.manual_seed(0)
    model = OddHeadLlama(config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(40.0)
    assert output_head(model) is None
    handle = TorchModel(model, None, "odd")
    batch = collate(examples([13, 7]), pad_id=0)
    logits = own_logits(model, batch)
    labels = torch.as_tensor(batch.labels)
    keep = labels != -100
    rows, head = head_inputs(model, model.get_decoder(), {"input_ids": torch.as_tensor(batch.input_ids)}, keep)
    assert not isinstance(head, OutputHead) and rows.shape == (int(keep.sum()), VOCAB)
    with torch.no_grad():
        loss, _ = backend.loss_sum(handle, batch)
    expected = -logits.log_softmax(-1)[keep].gather(-1, labels[keep][:, None]).sum()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


def test_head_reader_covers_the_transformers_families():
    """Read from each class's forward, without building a model."""
    import inspect

    from mudpuppy.backends.torch.model.heads import post_head_program

    def program(cls):
        return post_head_program(inspect.unwrap(cls.forward), "lm_head")

    softcap = (("if", ("config", "final_logit_softcapping"),
                (("div", ("config", "final_logit_softcapping")), ("tanh", None),
                 ("mul", ("config", "final_logit_softcapping")))),)
    assert program(transformers.Gemma3ForCausalLM) == softcap
    assert program(transformers.GraniteMoeForCausalLM) == (("div", ("config", "logits_scaling")),)
    assert program(transformers.FalconH1ForCausalLM) == (("mul", ("model", "lm_head_multiplier")),)
    for cls in (transformers.Qwen3ForCausalLM, transformers.Qwen3MoeForCausalLM, transformers.Phi3ForCausalLM,
                transformers.Olmo2ForCausalLM, transformers.MixtralForCausalLM, transformers.GptOssForCausalLM):
        assert program(cls) == (), cls.__name__
    # MiniCPM3 scales the hidden states before its head: not reproduced, so the full forward runs.
    assert program(transformers.MiniCPM3ForCausalLM) is None


# ------------------------------------------------------------------ part 2: attention and packing


def test_attention_is_sdpa_where_supported_else_eager():
    choice = {family: choose_attention("AutoModelForCausalLM", FAMILIES[family][0](**COMMON))
              for family in ("llama", "gemma2", "gemma3_text", "gpt_oss", "mistral")}
    assert choice == {"llama": "sdpa", "gemma2": "eager", "gemma3_text": "sdpa", "gpt_oss": "eager",
                      "mistral": "sdpa"}


def test_a_gemma2_checkpoint_loads_with_the_attention_it_supports(backend, tmp_path):
    from mudpuppy.config import ModelConfig

    model = build("gemma2")
    model.save_pretrained(tmp_path, safe_serialization=True)
    from tests.conftest import build_tokenizer

    build_tokenizer(tmp_path)
    handle = backend.load_model(ModelConfig(base_model=str(tmp_path)), "fp32")
    assert handle.model.config._attn_implementation == "eager"
    assert "eager attention" in handle.load_report.describe()


@pytest.mark.parametrize("family", ["llama", *SLIDING])
def test_packed_equals_padded_with_examples_longer_than_the_window(backend, models, family):
    handle = handle_for(models, family)
    exs = examples([11, 17, 8, 13], seed=1)
    packed = collate_packed([exs[:2], exs[2:]], pad_id=0)
    got = backend.logits(handle, packed)
    for row, group in enumerate((exs[:2], exs[2:])):
        at = 0
        for ex in group:
            alone = own_logits(handle.model, collate([ex], pad_id=0))[0].numpy()
            np.testing.assert_allclose(got[row, at : at + len(ex)], alone, atol=1e-5, rtol=1e-5)
            at += len(ex)
    with torch.no_grad():
        loss, n = backend.loss_sum(handle, packed)
        parts = [backend.loss_sum(handle, collate([e], pad_id=0)) for e in exs]
    assert n == sum(p[1] for p in parts)
    assert float(loss) == pytest.approx(sum(float(p[0]) for p in parts), rel=1e-5)


def test_sliding_layers_get_their_window_in_the_packed_mask(models):
    model = handle_for(models, "gemma3_text").model
    segments = torch.tensor([[1] * 10 + [2] * 4])
    masks = packing_mask(model, segments)
    assert set(masks) == {"full_attention", "sliding_attention"}
    full, sliding = masks["full_attention"][0, 0], masks["sliding_attention"][0, 0]
    assert full[9, 0] and not sliding[9, 0] and sliding[9, 9 - WINDOW + 1]
    assert not full[10, 9] and not sliding[10, 9]          # the second example sees nothing of the first
    mistral = packing_mask(handle_for(models, "mistral").model, segments)
    assert torch.is_tensor(mistral) and not mistral[0, 0, 9, 0]


def test_decoders_that_cannot_pack_exactly_are_refused_by_name():
    llama4 = decoder_masks(transformers.Llama4TextModel.forward)
    falcon = decoder_masks(transformers.FalconH1Model.forward)
    assert "create_chunked_causal_mask" in llama4[1] and "create_recurrent_attention_mask" in falcon[1]
    config = transformers.Llama4TextConfig(**{**COMMON, "num_local_experts": 2, "attention_chunk_size": 4,
                                             "intermediate_size_mlp": 128})
    model = transformers.Llama4ForCausalLM(config)
    with pytest.raises(MudpuppyError, match=r"data.packing: llama4_text .*create_chunked_causal_mask"):
        packing_mask(model, torch.ones(1, 6, dtype=torch.long))


def test_packing_problem_reads_the_config_before_any_weight_loads():
    from mudpuppy.data.packing import packing_problem

    def json_of(config_class, extra=None, **more):
        return config_class(**{**COMMON, **(extra or {}), **more}).to_dict()

    assert packing_problem(json_of(transformers.Gemma3TextConfig, sliding_window=WINDOW)) is None
    assert packing_problem(json_of(*FAMILIES["gpt_oss"])) is None
    assert packing_problem(json_of(transformers.LlamaConfig)) is None
    chunked = packing_problem(json_of(transformers.Llama4TextConfig, attention_chunk_size=4))
    assert chunked.startswith("llama4_text has chunked_attention layers")
    hybrid = packing_problem(json_of(transformers.FalconH1Config))
    assert hybrid.startswith("falcon_h1 has recurrent (Mamba) layers") and "data.packing: false" in hybrid
    assert "linear_attention layers" in packing_problem(json_of(transformers.Qwen3NextConfig))


def test_a_config_that_packs_a_chunked_model_is_refused_before_loading(tiny_config, tmp_path):
    """load_config reads the base's config.json: data.packing on Llama 4 is a config error naming the family."""
    import json

    from mudpuppy import load_config
    from mudpuppy.errors import ConfigError

    base = tmp_path / "llama4"
    base.mkdir()
    config = transformers.Llama4TextConfig(**{**COMMON, "attention_chunk_size": 4}).to_dict()
    (base / "config.json").write_text(json.dumps(config))
    tiny_config["model"]["base_model"] = str(base)
    tiny_config["data"]["packing"] = True
    with pytest.raises(ConfigError, match=r"data.packing: llama4_text has chunked_attention layers"):
        load_config(tiny_config)
    tiny_config["data"]["packing"] = False
    assert load_config(tiny_config).data.packing is False
