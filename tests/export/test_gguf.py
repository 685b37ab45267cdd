"""GGUF export: the bytes gguf's own quantizer writes, read back by transformers' GGUF loader
(an implementation independent of ours), and the tokenizer and template embedded."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mudpuppy.export import ExportRequest, export_model

from ..conftest import CHATML, build_tokenizer
from .conftest import RUN_TEMPLATE, greedy, logits

QUIET = dict(echo=lambda *_a, **_k: None)

# Hugging Face name (layer index as {i}) -> llama.cpp name, written out here rather than taken
# from gguf's TensorNameMap, which the exporter uses.
LLAMA_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    parts = hf.split(".")
    if parts[:2] == ["model", "layers"]:
        return LLAMA_NAMES["model.layers.{i}." + ".".join(parts[3:])].format(i=parts[2])
    return LLAMA_NAMES[hf]


def llama_cpp_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Per head, rows [0..d/2) and [d/2..d) interleaved as 0, d/2, 1, d/2+1, ...: llama.cpp's rotary
    pairs are adjacent where Hugging Face's are half a head apart."""
    d = w.shape[0] // heads
    order = np.concatenate([h * d + np.stack([np.arange(d // 2), d // 2 + np.arange(d // 2)], 1).reshape(-1)
                            for h in range(heads)])
    return w[order]


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory):
    """A tiny Llama whose feed-forward width (40) is not a multiple of the 32-value blocks."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("odd-llama")
    tok = build_tokenizer(path)
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         initializer_range=0.2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_quantized_bytes_equal_gguf_quantize_on_the_same_tensors(odd_model, tmp_path, quant):
    import gguf
    from gguf import GGMLQuantizationType as T
    from safetensors.numpy import load_file

    export_model(ExportRequest(str(odd_model), "gguf", str(tmp_path / "out"), quant=quant), **QUIET)
    reader = gguf.GGUFReader(str(tmp_path / "out" / f"model-{quant}.gguf"))
    written = {t.name: t for t in reader.tensors}
    config = json.loads((odd_model / "config.json").read_text())
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    expected = {}
    for hf, value in load_file(str(odd_model / "model.safetensors")).items():
        value = value.astype(np.float32)
        kind = hf.split(".")[-2]
        if kind in heads:
            value = llama_cpp_rows(value, heads[kind])
        name = gguf_name(hf)
        if value.ndim == 1:
            qtype = T.F32
        elif value.shape[-1] % 32:
            qtype = T.F16                      # the feed-forward down projection: 40 per row
        elif quant == "q4_0" and name == "token_embd.weight":
            qtype = T.Q8_0                     # tied: the embedding is the output matrix
        else:
            qtype = T.Q8_0 if quant == "q8_0" else T.Q4_0
        expected[name] = (qtype, gguf.quants.quantize(value, qtype))
    assert set(written) == set(expected)
    kinds = set()
    for name, (qtype, data) in expected.items():
        assert written[name].tensor_type == qtype, name
        assert written[name].data.tobytes() == data.tobytes(), name
        kinds.add(qtype)
    assert {T.F16, T.F32, T.Q8_0 if quant == "q8_0" else T.Q4_0} <= kinds


@pytest.fixture(scope="module")
def run_exports(lora_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("run-gguf")
    for quant in ("f32", "f16", "q8_0"):
        export_model(ExportRequest(str(lora_run), "gguf", str(root / quant), quant=quant), **QUIET)
    return root


def load_gguf(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def stored_as(model, quant: str):
    """The model with each matrix (3-D expert stacks too) rounded as the GGUF stores it; norms, biases and
    routers stay float32, as llama.cpp keeps them: float16, or gguf's own Q8_0 quantize-then-dequantize.
    Q8_0 blocks run along a row, so the exporter's row permutation of q/k commutes with it."""
    import copy

    import gguf
    import torch

    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if p.ndim < 2 or quant == "f32" or name.endswith(("mlp.gate.weight", "router.weight")):
                continue
            if quant == "f16":
                p.copy_(p.half().float())
            else:
                T = gguf.GGMLQuantizationType.Q8_0
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), T), T)))
    return rounded


PROMPTS = ("turn on the kitchen lights", "what's the weather like tomorrow in the garden")


@pytest.mark.parametrize("quant", ["f32", "f16", "q8_0"])
def test_a_run_read_back_by_transformers_matches_its_peft_merge(run_exports, peft_merged, quant):
    """Read back by transformers' GGUF loader, the export equals the PEFT merge stored at that precision:
    nothing but the rounding differs. (Quality on SmolLM2: docs/export.md, tests/slow.)"""
    model, tok = peft_merged
    back = load_gguf(run_exports / quant / f"model-{quant}.gguf")
    reference = stored_as(model, quant)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]
        ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"]
        assert np.abs(logits(back, ids) - logits(reference, ids)).max() < 1e-5
        assert greedy(back, ids, 8, stop) == greedy(reference, ids, 8, stop)
    if quant != "f32":        # and the rounding is visible: the comparison above is not vacuous
        assert np.abs(logits(reference, ids) - logits(model, ids)).max() > 1e-4


def test_the_training_template_tokenizer_and_special_ids_are_embedded(run_exports, lora_run):
    import gguf
    from transformers import AutoTokenizer

    from mudpuppy.data.templates import BUILTIN_TEMPLATES

    trained = AutoTokenizer.from_pretrained(str(lora_run))
    assert trained.chat_template == BUILTIN_TEMPLATES[RUN_TEMPLATE].jinja != CHATML
    path = run_exports / "f32" / "model-f32.gguf"
    reader = gguf.GGUFReader(str(path))
    field = lambda key: reader.fields[key].contents()   # noqa: E731
    assert field("tokenizer.chat_template") == trained.chat_template
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "gpt-2"
    assert field("tokenizer.ggml.eos_token_id") == trained.eos_token_id
    assert field("tokenizer.ggml.bos_token_id") == trained.bos_token_id
    assert field("tokenizer.ggml.padding_token_id") == trained.pad_token_id
    # zephyr closes an assistant turn with EOS: that is the end-of-turn token
    assert field("tokenizer.ggml.eot_token_id") == trained.eos_token_id
    assert field("tokenizer.ggml.add_bos_token") is False

    back = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert back.chat_template == trained.chat_template
    for text in ("please lock the front door", "set the thermostat to 21 degrees", "<|im_start|>user\nhi<|im_end|>"):
        assert back(text, add_special_tokens=False)["input_ids"] == trained(text, add_special_tokens=False)["input_ids"]


def test_qwen2_keeps_its_rotary_layout_and_biases(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    src = tmp_path / "qwen2"
    tok = build_tokenizer(src)
    torch.manual_seed(2)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         initializer_range=0.2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:           # biases are zero at init: make them count
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(src)
    export_model(ExportRequest(str(src), "gguf", str(tmp_path / "out"), quant="f32"), **QUIET)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), gguf_file="model-f32.gguf",
                                                dtype=torch.float32).eval()
    ids = tok("switch off the bedroom fan")["input_ids"]
    assert np.abs(logits(back, ids) - logits(model.eval(), ids)).max() < 1e-4


def test_llama3_rope_scaling_becomes_llama_cpp_frequency_factors():
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from mudpuppy.export.gguf import llama3_rope_factors

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=131072,
                         rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    dim = 64
    plain = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = llama3_rope_factors(config.to_dict())
    assert factors.shape == (dim // 2,) and factors.max() == pytest.approx(32.0)
    np.testing.assert_allclose(plain.numpy() / factors, scaled.numpy(), rtol=1e-5)
