"""Per-tensor types of K-quant files against tables derived by hand from llama.cpp's
llama_tensor_get_type (src/llama-quant.cpp in the llama-cpp-python 0.3.36 sdist; line numbers are
that file's), and a K-quant GGUF written, read back by gguf's reader and dequantized."""

from __future__ import annotations

import numpy as np
import pytest

from mudpuppy.export.kquant_recipes import ModelInfo, fallback, sort_key, tensor_types

PER_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def llama_like(n_layer: int, hidden: int, ffn: int, kv: int, tied: bool, vocab: int = 1000) -> dict:
    shapes = {"attn_norm": (hidden,), "ffn_norm": (hidden,), "attn_q": (hidden, hidden), "attn_k": (kv, hidden),
              "attn_v": (kv, hidden), "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden),
              "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    out = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        out["output.weight"] = (vocab, hidden)
    for i in range(n_layer):
        out.update({f"blk.{i}.{t}.weight": shapes[t] for t in PER_LAYER})
    return out


# use_more_bits(i, n) (llama-quant.cpp:452-454) worked out by hand: i < n/8, i >= 7n/8, (i - n/8) % 3 == 2
MORE_BITS_8 = {0, 3, 6, 7}
MORE_BITS_24 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23}
LLAMA8 = ModelInfo("llama", 8, 8, 2)          # n_gqa 4


def by_layer(types: dict, tensor: str, n_layer: int) -> list[str]:
    return [types[f"blk.{i}.{tensor}.weight"] for i in range(n_layer)]


def test_llama_q4_k_m():
    types = tensor_types(llama_like(8, 512, 1024, 128, tied=True), "q4_k_m", LLAMA8)
    assert types["token_embd.weight"] == "Q6_K"             # tied: quantized as the output (:490-510)
    assert types["output_norm.weight"] is None and types["blk.0.attn_norm.weight"] is None
    want = ["Q6_K" if i in MORE_BITS_8 else "Q4_K" for i in range(8)]
    assert by_layer(types, "attn_v", 8) == want             # :590-591
    assert by_layer(types, "ffn_down", 8) == want           # :646-652
    for t in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
        assert set(by_layer(types, t, 8)) == {"Q4_K"}


@pytest.mark.parametrize("ftype, attn_v, ffn_down, attn_output, rest", [
    # (:569-571 gqa >= 4 -> Q4_K; :627 ffn_down Q3_K; :680 attn_output Q3_K)
    ("q2_k", ["Q4_K"] * 8, ["Q3_K"] * 8, "Q3_K", "Q2_K"),
    ("q3_k_s", ["Q3_K"] * 8, ["Q3_K"] * 8, "Q3_K", "Q3_K"),
    # (:584-586 first two attn_v Q5_K; :632-635 ffn_down Q5_K below n/16 = 0 layers, else Q4_K; :682)
    ("q3_k_m", ["Q5_K"] * 2 + ["Q4_K"] * 6, ["Q4_K"] * 8, "Q4_K", "Q3_K"),
    ("q3_k_l", ["Q5_K"] * 8, ["Q5_K"] * 8, "Q5_K", "Q3_K"),         # :587, :641-643, :683
    ("q4_k_s", ["Q5_K"] * 4 + ["Q4_K"] * 4, ["Q5_K"] + ["Q4_K"] * 7, "Q4_K", "Q4_K"),   # :592, :656-658
    ("q5_k_s", ["Q5_K"] * 8, ["Q5_K"] * 8, "Q5_K", "Q5_K"),
    ("q5_k_m", ["Q6_K" if i in MORE_BITS_8 else "Q5_K" for i in range(8)],
     ["Q6_K" if i in MORE_BITS_8 else "Q5_K" for i in range(8)], "Q5_K", "Q5_K"),
    ("q6_k", ["Q6_K"] * 8, ["Q6_K"] * 8, "Q6_K", "Q6_K"),
])
def test_llama_every_file_type(ftype, attn_v, ffn_down, attn_output, rest):
    types = tensor_types(llama_like(8, 512, 1024, 128, tied=False), ftype, LLAMA8)
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == rest
    assert by_layer(types, "attn_v", 8) == attn_v
    assert by_layer(types, "ffn_down", 8) == ffn_down
    assert set(by_layer(types, "attn_output", 8)) == {attn_output}
    assert set(by_layer(types, "attn_q", 8) + by_layer(types, "ffn_up", 8)) == {rest}


def test_q4_0_takes_llama_quantizes_output_and_expert_rules():
    """llama-quantize's Q4_0 is not Q4_0 throughout: the output matrix is Q6_K (:490-510; the tied
    embedding when there is no output), Q8_0 where rows are no multiple of 256 (SmolLM2's 576, :409-415),
    and an 8-expert model's attn_v and attn_k Q8_0; everything else Q4_0."""
    types = tensor_types(llama_like(8, 512, 1024, 128, tied=False), "q4_0", LLAMA8)
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_0"
    assert {t for n, t in types.items() if n.startswith("blk.") and t is not None} == {"Q4_0"}
    tied = tensor_types(llama_like(8, 576, 1536, 64, tied=True), "q4_0", LLAMA8)
    assert tied["token_embd.weight"] == "Q8_0"
    assert {t for n, t in tied.items() if n.startswith("blk.") and t is not None} == {"Q4_0"}
    shapes = llama_like(8, 512, 1024, 128, tied=True)
    moe = tensor_types(shapes, "q4_0", ModelInfo("llama", 8, 8, 2, n_expert=8))
    assert moe["token_embd.weight"] == "Q6_K"
    assert set(by_layer(moe, "attn_v", 8) + by_layer(moe, "attn_k", 8)) == {"Q8_0"}
    assert set(by_layer(moe, "attn_output", 8) + by_layer(moe, "ffn_down", 8)) == {"Q4_0"}


def test_qwen_shaped_rows_fall_back():
    """Qwen2.5-0.5B's shape: hidden 896 is no multiple of 256, so Q4_K rows become Q5_0, the Q6_K ones
    Q8_0 (:409-415), and the tied embedding Q8_0 (:500-502); ffn_down's rows (4864) keep K-quants."""
    types = tensor_types(llama_like(24, 896, 4864, 128, tied=True), "q4_k_m", ModelInfo("qwen2", 24, 14, 2))
    assert types["token_embd.weight"] == "Q8_0"
    assert by_layer(types, "attn_v", 24) == ["Q8_0" if i in MORE_BITS_24 else "Q5_0" for i in range(24)]
    assert by_layer(types, "ffn_down", 24) == ["Q6_K" if i in MORE_BITS_24 else "Q4_K" for i in range(24)]
    assert set(by_layer(types, "attn_q", 24) + by_layer(types, "ffn_gate", 24)) == {"Q5_0"}
    assert fallback("Q5_K", 896) == "Q5_1" and fallback("Q2_K", 96) == "Q4_0" and fallback("Q4_K", 40) == "F16"


def test_eight_experts_and_70b():
    """Mixtral-like (8 experts): attn_v and attn_k Q8_0 (:597-601, :606-609), attn_output Q5_K (:672-677),
    ffn_down_exps by the layer in its name (:456-470). A 70B llama: attn_v Q3_K/Q4_K -> Q5_K (:593-596)."""
    shapes = llama_like(8, 512, 1024, 128, tied=False)
    for i in range(8):
        del shapes[f"blk.{i}.ffn_down.weight"]
        shapes[f"blk.{i}.ffn_down_exps.weight"] = (8, 512, 1024)
    types = tensor_types(shapes, "q4_k_m", ModelInfo("llama", 8, 8, 2, n_expert=8))
    assert set(by_layer(types, "attn_v", 8) + by_layer(types, "attn_k", 8)) == {"Q8_0"}
    assert set(by_layer(types, "attn_output", 8)) == {"Q5_K"}
    assert by_layer(types, "ffn_down_exps", 8) == ["Q6_K" if i in MORE_BITS_8 else "Q4_K" for i in range(8)]
    big = tensor_types(llama_like(80, 512, 1024, 128, tied=False), "q3_k_m", ModelInfo("llama", 80, 64, 8))
    assert set(by_layer(big, "attn_v", 80)) == {"Q5_K"}


def test_llama_quantize_order():
    names = ["blk.10.attn_q.weight", "output.weight", "blk.2.ffn_up.weight", "blk.2.attn_v.weight", "token_embd.weight"]
    assert sorted(names, key=sort_key) == ["output.weight", "token_embd.weight", "blk.2.attn_v.weight",
                                           "blk.2.ffn_up.weight", "blk.10.attn_q.weight"]


# --------------------------------------------------------------------------- a written file

@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """The tests' tiny Llama at hidden 256 (MLP 512, 2 layers, tied): rows that fill 256-value blocks."""
    from safetensors.numpy import load_file

    from ..conftest import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("wide-llama"), hidden_size=256)
    return path, load_file(str(path / "model.safetensors")), None


def write(path, quant, out, imatrix=None):
    from mudpuppy.export.gguf import write_gguf

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return write_gguf(path, tok, None, quant, out, "wide", imatrix=imatrix)


def test_q4_k_m_file_reads_back(wide_model, tmp_path):
    import gguf
    from gguf.quants import dequantize

    from mudpuppy.export.kquants import quantize

    path, weights, _ = wide_model
    record = write(path, "q4_k_m", tmp_path / "m.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tensors = {t.name: t for t in reader.tensors}
    assert [t.name for t in reader.tensors] == sorted(tensors, key=sort_key)
    # 2 layers: use_more_bits(1, 2) (1 >= 7*2/8), not layer 0
    want = {"token_embd.weight": "Q6_K", "blk.0.attn_v.weight": "Q4_K", "blk.1.attn_v.weight": "Q6_K",
            "blk.0.ffn_down.weight": "Q4_K", "blk.1.ffn_down.weight": "Q6_K", "blk.1.ffn_up.weight": "Q4_K",
            "blk.0.attn_norm.weight": "F32"}
    assert {k: tensors[k].tensor_type.name for k in want} == want
    assert record["tensor_types"] == {"F32": 5, "Q6_K": 3, "Q4_K": 12}
    source = {"token_embd.weight": "model.embed_tokens.weight", "blk.1.attn_v.weight": "model.layers.1.self_attn.v_proj.weight",
              "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight"}
    for name, hf in source.items():
        t = tensors[name]
        back = dequantize(np.asarray(t.data), t.tensor_type)
        w = weights[hf]
        assert np.sqrt(((back - w) ** 2).mean()) < 0.1 * np.sqrt((w ** 2).mean()), name
        np.testing.assert_array_equal(np.asarray(t.data).reshape(-1),
                                      quantize(w, t.tensor_type.name).reshape(-1))


def test_imatrix_weights_the_blocks(wide_model, tmp_path):
    import gguf

    from mudpuppy.errors import MudpuppyError
    from mudpuppy.export.kquants import quantize

    path, weights, _ = wide_model
    rng = np.random.default_rng(0)
    imatrix = {"blk.0.ffn_down.weight": rng.random(512).astype(np.float32) * 4,
               "blk.0.attn_q.weight": rng.random(256).astype(np.float32)}
    record = write(path, "q4_k_m", tmp_path / "w.gguf", imatrix)
    assert record["imatrix_tensors"] == 2
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "w.gguf")).tensors}
    w = weights["model.layers.0.mlp.down_proj.weight"]
    stored = np.asarray(tensors["blk.0.ffn_down.weight"].data).reshape(-1)
    np.testing.assert_array_equal(stored, quantize(w, "Q4_K", imatrix["blk.0.ffn_down.weight"]).reshape(-1))
    assert not np.array_equal(stored, quantize(w, "Q4_K").reshape(-1))
    with pytest.raises(MudpuppyError, match="holds 100 values for blk.0.attn_k.weight"):
        write(path, "q4_k_m", tmp_path / "bad.gguf", {"blk.0.attn_k.weight": np.ones(100, np.float32)})
    with pytest.raises(MudpuppyError, match="--imatrix weights K-quants"):
        write(path, "q8_0", tmp_path / "q8.gguf", imatrix)


def test_moe_experts_take_their_own_rows_of_the_imatrix(tmp_path):
    """Stacked experts [E, out, in]: expert e is quantized with columns e*in..(e+1)*in of the entry
    (llama-quant.cpp:784-786); compared with the same experts read from the f32 file."""
    import gguf
    from transformers import AutoTokenizer

    from mudpuppy.export.gguf import write_gguf
    from mudpuppy.export.kquants import quantize

    from .test_gguf_families import build

    src = tmp_path / "moe"
    build("qwen3moe", src)
    tok = AutoTokenizer.from_pretrained(src)
    write_gguf(src, tok, None, "f32", tmp_path / "f32.gguf", "moe")
    exact = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(tmp_path / "f32.gguf")).tensors}
    down = exact["blk.1.ffn_down_exps.weight"]                       # [4 experts, 64, 768]
    n_in = down.shape[-1]
    rows = np.random.default_rng(1).random(4 * n_in).astype(np.float32)
    write_gguf(src, tok, None, "q4_k_m", tmp_path / "k.gguf", "moe", imatrix={"blk.1.ffn_down_exps.weight": rows})
    stored = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "k.gguf")).tensors}
    assert stored["blk.1.ffn_down_exps.weight"].tensor_type.name == "Q6_K"    # use_more_bits(1, 2)
    assert stored["blk.0.ffn_down_exps.weight"].tensor_type.name == "Q4_K"
    want = np.stack([quantize(down[e], "Q6_K", rows[e * n_in:(e + 1) * n_in]) for e in range(4)])
    np.testing.assert_array_equal(np.asarray(stored["blk.1.ffn_down_exps.weight"].data).reshape(-1),
                                  want.reshape(-1))
    assert not np.array_equal(want, quantize(down, "Q6_K"))
