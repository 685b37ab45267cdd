"""GGUF for every family llama.cpp reads, on tiny random models (hidden 64, 2 layers; MoE 4 experts,
top 2) built from transformers' config classes.

Where transformers' GGUF loader knows the family (Qwen3, Qwen3-MoE, Gemma 2, Gemma 3, Phi-3), the
export is read back by it and its logits equal the source model's, rounded as the file stores it.
Where it does not (Granite, OLMo 2, Mixtral, SmolLM3, GLM-4, Cohere, gpt-oss: transformers has no
reader for them, or a broken one), the file is checked against what llama.cpp's loader asks for, transcribed here from
llama.cpp's src/models/<arch>.cpp (load_arch_tensors / load_arch_hparams): every tensor it creates
with the shape it creates it with, every metadata key it reads with the config's value, and each
tensor equal to the Hugging Face one through the inverse of the family's transform. llama.cpp
itself is the readers tier at the end (`make test-readers`; skipped without llama-cpp-python).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from click.testing import CliRunner

from mudpuppy.cli import main
from mudpuppy.export import ExportRequest, export_model

from ..conftest import build_tokenizer
from ..readers.cpp import HAVE_LLAMA_CPP, REASON
from .conftest import logits
from .test_gguf import llama_cpp_rows, stored_as

QUIET = dict(echo=lambda *_a, **_k: None)
TEXT = "turn on the kitchen lights and then switch off the bedroom fan please"

# family -> (transformers config class, options beyond the common tiny shape)
FAMILIES = {
    # transformers' qwen3 GGUF reader does not read head_dim: keep its default (128)
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False)),
    # ...nor moe_intermediate_size (default 768); norm_topk_prob as llama.cpp computes it
    "qwen3moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16)),
    # query_pre_attn_scalar = head_dim is what llama.cpp scales by; 256 is also transformers' default
    "gemma2": ("Gemma2Config", dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4)),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False)),
    "granite": ("GraniteConfig", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                      attention_multiplier=0.0078125, logits_scaling=8.0)),
    "olmo2": ("Olmo2Config", dict(tie_word_embeddings=True)),      # tied: llama.cpp still wants output.weight
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "gptoss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=4)),
    # 4 layers: the 4th is a no-rope layer, in llama.cpp (hard-coded) and in transformers (no_rope_layers)
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, tie_word_embeddings=True)),
    # q/k/v biases, fused gate_up_proj, post norms, and only the first half of each head rotated
    "glm4": ("Glm4Config", dict(head_dim=16, attention_bias=True, tie_word_embeddings=False)),
    # LayerNorm, parallel attention + MLP, a head always tied, logits scaled (by a value that shows)
    "cohere": ("CohereConfig", dict(logit_scale=0.5, tie_word_embeddings=True)),
}
READ_BACK = ("qwen3", "qwen3moe", "gemma2", "gemma3", "phi3")
# One seed per family, fixed: a new row must not reseed the others (gpt-oss's greedy answers, for one, agree
# with llama.cpp's only where no choice is near a tie that its YaRN note can flip).
SEEDS = {f: i for i, f in enumerate(("gemma2", "gemma3", "gptoss", "granite", "mixtral", "olmo2", "phi3", "qwen3",
                                     "qwen3moe", "cohere", "glm4", "smollm3"))}


def build(family: str, path, **extra):
    """The tiny model of `family` saved to `path`; `extra`: config options beyond FAMILIES'."""
    import torch
    import transformers

    tok = build_tokenizer(path)
    cls, options = FAMILIES[family]
    options = {**options, **extra}
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)
    config = getattr(transformers, cls)(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, **{**shape, **options})
    torch.manual_seed(SEEDS[family])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")) or "norm" in name:     # zeros / ones at init: make them count
                p.add_(torch.randn_like(p) * 0.3)
        if family == "gemma2":      # logits big enough that final soft-capping (30) acts
            model.model.embed_tokens.weight.mul_(40)
    model.save_pretrained(path)
    return model, tok


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Every family built once and exported at f32 and f16: {family: (model, tok, source dir, out root)}."""
    built = {}
    for family in FAMILIES:
        # Not named after the family: llama.cpp gives a model whose general.name (the source directory's name)
        # contains "phi3" Phi-3's token attributes, and its loader fails on a vocab without </s>, <unk> and <s>,
        # which this tiny byte-level tokenizer lacks and Phi-3's own has.
        src = tmp_path_factory.mktemp(f"tiny-{SEEDS[family]}")
        model, tok = build(family, src)
        root = tmp_path_factory.mktemp(f"{family}-gguf")
        for quant in ("f32", "f16"):
            export_model(ExportRequest(str(src), "gguf", str(root / quant), quant=quant), **QUIET)
        built[family] = (model, tok, src, root)
    return built


def read_back(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.mark.parametrize("quant", ["f32", "f16"])
@pytest.mark.parametrize("family", READ_BACK)
def test_read_back_by_transformers_equals_the_source_model(exports, family, quant):
    model, tok, _, root = exports[family]
    back = read_back(root / quant / f"model-{quant}.gguf")
    ids = tok(TEXT)["input_ids"]
    assert len(ids) > 4                                       # past Gemma's sliding window of 4
    reference = logits(stored_as(model, quant), ids)
    assert np.abs(logits(back, ids) - reference).max() < 1e-4
    if family == "gemma2":                                    # soft-capping acted: the bound is reached
        assert np.abs(reference).max() > 25
    if quant == "f16":                                        # the rounding is visible: not vacuous
        assert np.abs(reference - logits(model, ids)).max() > 1e-5


def test_q8_0_of_an_moe_model_reads_back_as_its_q8_0_rounding(exports, tmp_path):
    model, tok, src, _ = exports["qwen3moe"]
    export_model(ExportRequest(str(src), "gguf", str(tmp_path / "q8"), quant="q8_0"), **QUIET)
    path = tmp_path / "q8" / "model-q8_0.gguf"
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.0.attn_q.weight"] == "Q8_0"
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.attn_q_norm.weight"] == "F32"
    ids = tok(TEXT)["input_ids"]
    reference = logits(stored_as(model, "q8_0"), ids)
    assert np.abs(logits(read_back(path), ids) - reference).max() < 1e-4
    assert np.abs(reference - logits(model, ids)).max() > 1e-4


# --------------------------------------------------------------------------- llama.cpp's loader, transcribed

def llama_cpp_tensors(family: str, c: dict) -> dict[str, tuple[int, ...]]:
    """name -> ggml shape (ne, innermost first) of each tensor llama.cpp's load_arch_tensors creates
    for these configs (required ones, and the optional ones these models have)."""
    H, V, F = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or H // nh
    E = c.get("num_local_experts") or c.get("num_experts")
    q, kv = nh * hd, nkv * hd
    attn = {"attn_q.weight": (H, q), "attn_k.weight": (H, kv), "attn_v.weight": (H, kv), "attn_output.weight": (q, H)}
    mlp = {"ffn_gate.weight": (H, F), "ffn_up.weight": (H, F), "ffn_down.weight": (F, H)}
    top = {"token_embd.weight": (H, V), "output_norm.weight": (H,)}
    if (not c.get("tie_word_embeddings") or family in ("olmo2", "gptoss")) and family != "cohere":
        top["output.weight"] = (H, V)                  # command-r: always token_embd, never output.weight
    if family in ("qwen3", "granite", "smollm3"):
        block = {"attn_norm.weight": (H,), **attn, "ffn_norm.weight": (H,), **mlp}
        if family == "qwen3":
            block.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
    elif family in ("qwen3moe", "mixtral"):
        Fe = c.get("moe_intermediate_size") or F
        block = {"attn_norm.weight": (H,), **attn, "ffn_norm.weight": (H,), "ffn_gate_inp.weight": (H, E),
                 "ffn_gate_exps.weight": (H, Fe, E), "ffn_up_exps.weight": (H, Fe, E),
                 "ffn_down_exps.weight": (Fe, H, E)}
        if family == "qwen3moe":
            block.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
    elif family in ("gemma2", "gemma3"):
        block = {"attn_norm.weight": (H,), **attn, "post_attention_norm.weight": (H,), "ffn_norm.weight": (H,),
                 **mlp, "post_ffw_norm.weight": (H,)}
        if family == "gemma3":
            block.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
    elif family == "phi3":
        block = {"attn_norm.weight": (H,), "attn_qkv.weight": (H, H + 2 * kv), "attn_output.weight": (H, H),
                 "ffn_norm.weight": (H,), "ffn_down.weight": (F, H), "ffn_up.weight": (H, 2 * F)}
    elif family == "olmo2":
        block = {**attn, "attn_q_norm.weight": (H,), "attn_k_norm.weight": (nkv * (H // nh),),
                 "post_attention_norm.weight": (H,), **mlp, "post_ffw_norm.weight": (H,)}
    elif family == "glm4":
        block = {"attn_norm.weight": (H,), **attn, "attn_q.bias": (q,), "attn_k.bias": (kv,),   # optional, present
                 "attn_v.bias": (kv,), "post_attention_norm.weight": (H,), "ffn_norm.weight": (H,),
                 "ffn_down.weight": (F, H), "ffn_up.weight": (H, 2 * F), "post_ffw_norm.weight": (H,)}
    elif family == "cohere":                           # fewer than 64 layers: no q/k norms
        block = {"attn_norm.weight": (H,), **attn, **mlp}
    elif family == "gptoss":
        Fe = F
        block = {"attn_norm.weight": (H,), "post_attention_norm.weight": (H,), **attn,
                 "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),     # optional, present
                 "attn_sinks.weight": (nh,), "ffn_gate_inp.weight": (H, E), "ffn_gate_exps.weight": (H, Fe, E),
                 "ffn_down_exps.weight": (Fe, H, E), "ffn_up_exps.weight": (H, Fe, E), "attn_output.bias": (H,),
                 "ffn_gate_inp.bias": (E,), "ffn_gate_exps.bias": (Fe, E), "ffn_down_exps.bias": (H, E),
                 "ffn_up_exps.bias": (Fe, E)}
    out = dict(top)
    for i in range(c["num_hidden_layers"]):
        out.update({f"blk.{i}.{k}": v for k, v in block.items()})
    return out


ARCH = {"qwen3": "qwen3", "qwen3moe": "qwen3moe", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3",
        "granite": "granite", "olmo2": "olmo2", "mixtral": "llama", "gptoss": "gpt-oss", "smollm3": "smollm3",
        "glm4": "glm4", "cohere": "command-r"}


def llama_cpp_keys(family: str, c: dict) -> dict[str, object]:
    """Metadata llama.cpp's load_hparams (common, then per arch) reads, with the value it must hold."""
    rope = c.get("rope_parameters") or {}
    theta = (rope.get("full_attention") or rope).get("rope_theta")
    keys = {"context_length": c["max_position_embeddings"], "embedding_length": c["hidden_size"],
            "block_count": c["num_hidden_layers"], "feed_forward_length": c["intermediate_size"],
            "attention.head_count": c["num_attention_heads"], "attention.head_count_kv": c["num_key_value_heads"],
            "rope.freq_base": theta}
    if family == "cohere":                             # LayerNorm: llama.cpp reads the plain epsilon
        keys.update({"attention.layer_norm_epsilon": c["layer_norm_eps"], "logit_scale": c["logit_scale"],
                     "rope.scaling.type": "none"})
    else:
        keys["attention.layer_norm_rms_epsilon"] = c["rms_norm_eps"]
    if family in ("qwen3moe", "mixtral", "gptoss"):
        keys.update({"expert_count": 4, "expert_used_count": 2})
    if family == "qwen3moe":
        keys["expert_feed_forward_length"] = c["moe_intermediate_size"]
    if family == "gptoss":
        keys.update({"expert_feed_forward_length": c["intermediate_size"], "attention.sliding_window": 4,
                     "attention.sliding_window_pattern": [t == "sliding_attention" for t in c["layer_types"]],
                     "rope.scaling.type": "yarn", "rope.scaling.factor": rope["factor"],
                     "rope.scaling.original_context_length": rope["original_max_position_embeddings"]})
    if family in ("gemma2", "gemma3"):
        keys.update({"attention.sliding_window": 4, "attention.key_length": c["head_dim"],
                     "attention.sliding_window_pattern": [t == "sliding_attention" for t in c["layer_types"]]})
    if family == "gemma2":
        keys.update({"attn_logit_softcapping": c["attn_logit_softcapping"],
                     "final_logit_softcapping": c["final_logit_softcapping"]})
    if family == "gemma3":
        keys["rope.freq_base_swa"] = rope["sliding_attention"]["rope_theta"]
    if family == "granite":
        keys.update({"logit_scale": c["logits_scaling"], "residual_scale": c["residual_multiplier"],
                     "embedding_scale": c["embedding_multiplier"], "attention.scale": c["attention_multiplier"]})
    if family in ("granite", "mixtral", "smollm3"):
        keys["rope.dimension_count"] = c["hidden_size"] // c["num_attention_heads"]
    if family == "glm4":                               # partial rotary: half of each head
        keys.update({"rope.dimension_count": c["head_dim"] // 2, "attention.key_length": c["head_dim"]})
    if family == "phi3":
        keys.update({"rope.dimension_count": c["hidden_size"] // c["num_attention_heads"],
                     "attention.sliding_window": 0})
    return keys


def gguf_values(family: str, c: dict, reader) -> dict[str, np.ndarray]:
    """The GGUF's tensors through the inverse of the family's transforms: q/k rows unpermuted (llama,
    granite, mixtral, smollm3), Gemma's norms minus 1."""
    import gguf

    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    out = {}
    for t in reader.tensors:
        value = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if family in ("granite", "mixtral", "smollm3") and ".attn_q." in t.name:
            value = unpermute(value, nh)
        if family in ("granite", "mixtral", "smollm3") and ".attn_k." in t.name:
            value = unpermute(value, nkv)
        if family.startswith("gemma") and t.name.endswith("norm.weight"):
            value = value - 1
        out[t.name] = value
    return out


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    order = np.argsort(llama_cpp_rows(np.arange(w.shape[0]), heads))
    return w[order]


def expected_values(family: str, model) -> dict[str, np.ndarray]:
    """The source model's tensors in the layout the inverse transform returns: experts stacked
    [E, out, in] with gate and up apart (gpt-oss: columns interleaved and (in, out) in Hugging Face)."""
    out = {}
    for key, value in model.state_dict().items():
        value = value.float().numpy()
        if key.endswith("experts.gate_up_proj") or key.endswith("experts.gate_up_proj_bias"):
            base, bias = key.rsplit(".", 1)[0], key.endswith("_bias")
            suffix = ".bias" if bias else ".weight"
            if family == "gptoss":
                v = value if bias else value.swapaxes(-1, -2)
                gate, up = v[..., ::2] if bias else v[:, ::2], v[..., 1::2] if bias else v[:, 1::2]
            else:
                half = value.shape[1] // 2
                gate, up = value[:, :half], value[:, half:]
            out[f"{base}.gate_proj{suffix}"], out[f"{base}.up_proj{suffix}"] = gate, up
        elif key.endswith("experts.down_proj") or key.endswith("experts.down_proj_bias"):
            base, bias = key.rsplit(".", 1)[0], key.endswith("_bias")
            v = value.swapaxes(-1, -2) if family == "gptoss" and not bias else value
            out[f"{base}.down_proj{'.bias' if bias else '.weight'}"] = v
        elif key.endswith("sinks"):
            out[key + ".weight"] = value
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_file_is_what_llama_cpp_loads(exports, family):
    import gguf

    model, _, src, root = exports[family]
    c = json.loads((src / "config.json").read_text())
    reader = gguf.GGUFReader(str(root / "f32" / "model-f32.gguf"))
    arch = reader.fields["general.architecture"].contents()
    assert arch == ARCH[family]

    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}     # ggml order
    assert shapes == llama_cpp_tensors(family, c)

    for key, value in llama_cpp_keys(family, c).items():
        field = reader.fields.get(f"{arch}.{key}")
        assert field is not None, key
        got = field.contents()
        assert got == (value if isinstance(value, str) else pytest.approx(value, rel=1e-6)), key

    # every tensor is the Hugging Face one through the inverse transform (f32: exactly), named by
    # gguf's TensorNameMap from the names the model holds in memory (fused experts and all)
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     c["num_hidden_layers"])
    back, seen = gguf_values(family, c, reader), set()
    for key, value in expected_values(family, model).items():
        if key == "lm_head.weight" and c.get("tie_word_embeddings"):
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name in back, (key, name)
        np.testing.assert_allclose(back[name], value, rtol=0, atol=1e-6 if family.startswith("gemma") else 0,
                                   err_msg=key)
        seen.add(name)
    copies = {"output.weight"} if c.get("tie_word_embeddings") else set()
    assert set(back) - seen == copies & set(back)


def test_the_template_and_family_notes_are_recorded(exports):
    _, tok, _, root = exports["gptoss"]
    import gguf

    reader = gguf.GGUFReader(str(root / "f16" / "model-f16.gguf"))
    assert reader.fields["tokenizer.chat_template"].contents() == tok.chat_template
    record = json.loads((root / "f16" / "export.json").read_text())["gguf"]
    assert record["architecture"] == "gpt-oss" and "YaRN" in record["notes"][0]


# --------------------------------------------------------------------------- refusals

def mudpuppy(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("family, change, named", [
    ("qwen3moe", {"norm_topk_prob": False}, "norm_topk_prob"),
    ("gemma2", {"query_pre_attn_scalar": 144}, "query_pre_attn_scalar 144"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gptoss", {"swiglu_limit": 5.0}, "swiglu_limit"),
    ("granite", {"mlp_bias": True}, "mlp_bias"),
    ("phi3", {"hidden_act": "gelu"}, "activation gelu"),
    ("mixtral", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}, "'dynamic'"),
    ("smollm3", {"no_rope_layers": [1, 1, 1, 1]}, "no_rope_layers [1, 1, 1, 1]"),
    ("smollm3", {"attention_bias": True}, "attention_bias"),
    ("glm4", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 12, 12]}},
     "mrope_section"),
    ("cohere", {"tie_word_embeddings": False}, "not tied to the embedding"),
    ("cohere", {"use_qk_norm": True}, "use_qk_norm: true with 2 layers"),
])
def test_what_llama_cpp_would_compute_differently_is_refused_before_any_weight_loads(
        exports, tmp_path, family, change, named):
    import shutil

    _, _, src, _ = exports[family]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    (bad / "model.safetensors").unlink()          # no weights at all: the refusal comes first
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, **change}))
    done = mudpuppy("export", bad, "--format", "gguf", "--out", tmp_path / "out")
    assert done.exit_code == 2, done.output
    assert named in done.output and config["architectures"][0] in done.output
    assert "--format merged" in done.output and "--format mlx" in done.output
    assert "Traceback" not in done.output and not (tmp_path / "out").exists()


def test_a_family_without_a_row_is_refused_naming_the_alternatives(tmp_path):
    bad = tmp_path / "falcon"
    build_tokenizer(bad)
    (bad / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}))
    done = mudpuppy("export", bad, "--format", "gguf", "--out", tmp_path / "out")
    assert done.exit_code == 2 and "FalconForCausalLM" in done.output
    assert "Qwen3MoeForCausalLM" in done.output and "--format merged" in done.output and "--format mlx" in done.output


# --------------------------------------------------------------------------- llama.cpp itself

@pytest.mark.readers
@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason=REASON)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_cpp_answers_greedily_as_the_source_model(exports, family):
    """llama.cpp (llama-cpp-python) loads each family's f32 GGUF and decodes greedily the same tokens
    as the source model in torch (float32 KV cache)."""
    import llama_cpp
    import torch

    model, tok, _, root = exports[family]
    llm = llama_cpp.Llama(model_path=str(root / "f32" / "model-f32.gguf"), n_ctx=128, logits_all=True,
                          type_k=0, type_v=0, verbose=False)        # GGML_TYPE_F32 cache
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        want = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              do_sample=False, max_new_tokens=8, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    got = []
    for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        got.append(token)
        if len(got) == len(want):
            break
    assert got == want


# Gemma: 1.4e-3 / 1.5e-3 against torch as is: ggml's CPU GELU rounds its input to fp16 and reads a table of fp16
# values (GGML_GELU_FP16 in ggml-cpu/vec.h). With torch's GELU doing the same the median position agrees to 2e-5,
# but where llama.cpp's gate pre-activation (equal to torch's to ~1e-6 relative: float32 summation order) lies
# next to an fp16 rounding midpoint the two round it to neighbouring fp16 values and that GELU output moves by one
# fp16 step (~1e-3 relative): up to 6e-4 in the logits, seed-dependent. So the fp16 rounding is taken from
# llama.cpp's own gate tensors ("ffn_gate-<layer>", through its eval callback); then 3e-5 / 6e-6, and Gemma is
# held to the 1e-4 of the other families.
# gpt-oss: 0.14 where its YaRN note acts; its greedy answers are the test.
GGML_GELU = ("gemma2", "gemma3")


def llama_cpp_logits_and_gates(path, ids, monkeypatch) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """llama.cpp's logits for `ids` (f32 KV cache) and each layer's FFN gate pre-activations as it computed
    them, [tokens, n_ff]: the graph's "ffn_gate-<layer>" tensors, read by llama.cpp's eval callback."""
    import ctypes

    import llama_cpp
    import llama_cpp.llama_cpp as api

    class Tensor(ctypes.Structure):                       # ggml.h's struct ggml_tensor, up to its name
        _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                    ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                    ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                    ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]

    gates = {}

    @api.ggml_backend_sched_eval_callback
    def observe(pointer, ask, _user_data):
        t = ctypes.cast(pointer, ctypes.POINTER(Tensor)).contents
        name = t.name.decode()
        if ask:
            return name.startswith("ffn_gate-")
        n_ff, n_tokens = t.ne[0], t.ne[1]
        assert t.type == 0 and t.nb[0] == 4 and t.nb[1] == 4 * n_ff and t.ne[2] == t.ne[3] == 1, name  # f32 rows
        layer = int(name.split("-")[1])
        assert layer not in gates, name                   # one micro-batch
        gates[layer] = np.ctypeslib.as_array((ctypes.c_float * (n_ff * n_tokens)).from_address(t.data)) \
            .reshape(n_tokens, n_ff).copy()
        return True

    defaults = api.llama_context_default_params

    def with_callback():
        params = defaults()
        params.cb_eval = observe
        return params

    monkeypatch.setattr(api, "llama_context_default_params", with_callback)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, type_k=0, type_v=0, verbose=False)
    monkeypatch.setattr(api, "llama_context_default_params", defaults)
    llm.eval(ids)
    return np.asarray(llm.scores[:len(ids)]), gates


def with_ggml_gelu(model, gates: dict[int, np.ndarray] | None = None):
    """A copy of `model` whose MLP GELU is ggml's CPU one: the input rounded to fp16, the tanh approximation
    read from a table of fp16 values, 0 below -10 and the identity above 10 (ggml-cpu/vec.h,
    ggml_vec_gelu_f32 under GGML_GELU_FP16). `gates` (layer -> llama.cpp's gate pre-activations): the fp16
    value looked up is llama.cpp's rounding of its own input, not torch's."""
    import copy

    import torch

    class GgmlGelu(torch.nn.Module):
        def __init__(self, rounded_from=None):
            super().__init__()
            self.rounded_from = None if rounded_from is None else torch.from_numpy(rounded_from)

        def forward(self, x):
            src = x if self.rounded_from is None else self.rounded_from.reshape(x.shape)
            y = torch.nn.functional.gelu(src.half().float(), approximate="tanh").half().float()
            return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))

    model = copy.deepcopy(model)
    for i, layer in enumerate(model.model.layers):
        layer.mlp.act_fn = GgmlGelu(None if gates is None else gates[i])
    return model


@pytest.mark.readers
@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason=REASON)
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gptoss"])
def test_llama_cpp_logits_equal_the_source_models(exports, family, monkeypatch):
    """Every position's logits, not only the argmax: what greedy decoding cannot see (Cohere's logit_scale,
    a rotary embedding on the wrong layers or dimensions) shows here."""
    model, tok, _, root = exports[family]
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    got, gates = llama_cpp_logits_and_gates(root / "f32" / "model-f32.gguf", ids, monkeypatch)
    if family in GGML_GELU:
        model = with_ggml_gelu(model, gates)
    np.testing.assert_allclose(got, logits(model, ids), atol=1e-4, rtol=0)


def test_gpt_oss_and_gpt_4o_byte_level_split_is_named_for_llama_cpp():
    """gpt-oss's tokenizer (o200k) splits with the regex llama.cpp calls gpt-4o."""
    from mudpuppy.export.gguf_vocab import GPT4O_SPLIT, byte_level_pre

    spec = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": GPT4O_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}}
    assert byte_level_pre(spec) == "gpt-4o"
