"""A GGUF export's report: the written quant's held-out perplexity beside the merged model's (export/quality.py),
measured by dequantizing the GGUF with gguf-py and scoring it through the backend as any model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ..conftest import QUICKSTART_DATA, build_tiny_model
from ..readers.cpp import READERS
from .conftest import mudpuppy, trained_run
from .test_cli import one_error
from .test_gguf_families import FAMILIES, build

TRAIN = QUICKSTART_DATA / "smart_home_train.jsonl"


@pytest.fixture(scope="module")
def learned_run(tmp_path_factory) -> Path:
    """A full fine-tune of a tiny Llama 256 wide (rows that fill K-quant blocks: Q4_K and Q6_K, not the
    fallbacks of narrower rows) that has learned its training examples: near a minimum of their loss, where
    rounding the weights costs (on a random model, noise on the logits can as well help)."""
    root = tmp_path_factory.mktemp("ppl-run")
    return trained_run(root, build_tiny_model(root / "base", hidden_size=256), dict(max_steps=60, learning_rate=1e-2),
                       adapter={"type": "none"})


@pytest.fixture(scope="module")
def scored(learned_run, tmp_path_factory):
    """{quant: (export.json, output)} for the trained tiny run exported at four quants, scored on the examples it
    trained on (the first 64 of the file; 1,500 tokens stay within them)."""
    root = tmp_path_factory.mktemp("ppl")
    out = {}
    for quant in ("f32", "q8_0", "q4_0", "q4_k_m"):
        done = mudpuppy("export", learned_run, "--format", "gguf", "--quant", quant, "--out", root / quant,
                        "--eval-data", TRAIN, "--eval-tokens", 1500)
        assert done.exit_code == 0, done.output
        out[quant] = (json.loads((root / quant / "export.json").read_text()), done.output)
    return out


def test_an_f32_gguf_scores_what_the_merged_model_scores(scored):
    record, output = scored["f32"]
    ppl = record["perplexity"]
    assert ppl["data"].endswith("smart_home_train.jsonl") and 1500 <= ppl["tokens"] and ppl["scored_tokens"] > 0
    assert ppl["quants"]["f32"]["mudpuppy"] == pytest.approx(ppl["merged"], rel=1e-6)
    lines = output.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("held-out perplexity on ")))
    assert lines[at + 1].split() == ["merged", f"{ppl['merged']:.4f}"]
    assert lines[at + 2].split()[:2] == ["f32", f"{ppl['quants']['f32']['mudpuppy']:.4f}"]
    assert "dequantized evaluation" in lines[at + 2]


def test_quantized_ggufs_score_as_their_precision_says(scored):
    merged = scored["f32"][0]["perplexity"]["merged"]
    values = {}
    for quant, (record, output) in scored.items():
        ppl = record["perplexity"]
        assert ppl["merged"] == pytest.approx(merged, rel=1e-9)          # the same merged model, the same data
        values[quant] = ppl["quants"][quant]["mudpuppy"]
        assert sum(line.split()[:1] == [quant] for line in output.splitlines()) == 1 + ("llama_cpp" in
                                                                                        ppl["quants"][quant])
    print(json.dumps(values | {"merged": merged}))
    assert values["q8_0"] == pytest.approx(merged, rel=5e-3) and values["q8_0"] != merged
    assert values["q4_0"] > values["q8_0"] and values["q4_k_m"] > values["q8_0"]
    assert values["q4_0"] > merged * 1.001 and values["q4_k_m"] > merged * 1.001
    types = scored["q4_k_m"][0]["gguf"]["tensor_types"]
    assert types.get("Q4_K") and types.get("Q6_K"), types          # the real K-quant blocks were scored


@READERS[0]
@READERS[1]
def test_the_report_reads_the_file_through_llama_cpp_too(scored):
    """Where llama_cpp imports, each file is also scored by llama.cpp's own evaluation: within 1% of mudpuppy's
    dequantized evaluation (llama.cpp rounds activations in its quantized products; f32 differs by arithmetic)."""
    for quant, (record, output) in scored.items():
        measured = record["perplexity"]["quants"][quant]
        assert abs(math.log(measured["llama_cpp"] / measured["mudpuppy"])) < 0.01, (quant, measured)
        assert "llama.cpp 0.3." in output


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_dequantized_weights_go_back_where_the_writer_took_them(family, tmp_path):
    """At f32 every value comes back bit for bit under its Hugging Face name (q/k un-permuted, experts
    unstacked, fused experts fused again, Gemma's norms unshifted); a tied head llama.cpp wants apart comes back
    as lm_head."""
    from transformers import AutoTokenizer

    from mudpuppy.export.gguf import write_gguf
    from mudpuppy.export.gguf_families import FAMILIES as WRITER_FAMILIES
    from mudpuppy.export.quality import dequantized_weights
    from mudpuppy.export.tensors import model_tensors

    build(family, tmp_path / "model")
    gguf = tmp_path / "model.gguf"
    write_gguf(tmp_path / "model", AutoTokenizer.from_pretrained(str(tmp_path / "model")), None, "f32", gguf, family)
    weights, config = dequantized_weights(gguf, tmp_path / "model")
    stored = {k: t for k, t in model_tensors(tmp_path / "model").items() if not k.endswith("inv_freq")}
    original = json.loads((tmp_path / "model" / "config.json").read_text())
    tied = original.get("tie_word_embeddings", False)
    required = WRITER_FAMILIES[original["architectures"][0]].output == "required"
    assert set(weights) == set(stored) | ({"lm_head.weight"} if tied and required else set())
    assert config.get("tie_word_embeddings", False) == (tied and not required)
    for key, tensor in stored.items():
        np.testing.assert_allclose(weights[key], tensor.float32(), rtol=0, atol=1e-6, err_msg=key)
        if "norm" not in key:
            assert np.array_equal(weights[key], tensor.float32()), key
    if tied and required:
        assert np.array_equal(weights["lm_head.weight"], stored["model.embed_tokens.weight"].float32())


def test_a_model_is_measured_on_the_data_given(tiny_model_dir, tmp_path):
    plain = mudpuppy("export", tiny_model_dir, "--format", "gguf", "--quant", "q8_0", "--out", tmp_path / "a")
    assert plain.exit_code == 0, plain.output
    assert "held-out perplexity: not measured: " in plain.output and "--eval-data FILE" in plain.output
    assert "perplexity" not in json.loads((tmp_path / "a" / "export.json").read_text())
    given = mudpuppy("export", tiny_model_dir, "--format", "ollama", "--quant", "q8_0", "--out", tmp_path / "b",
                     "--eval-data", QUICKSTART_DATA / "smart_home_val.jsonl", "--eval-tokens", 300)
    assert given.exit_code == 0, given.output
    ppl = json.loads((tmp_path / "b" / "export.json").read_text())["perplexity"]
    # The first records whose tokens reach 300, the one that crosses included.
    assert 300 <= ppl["tokens"] < 400 and ppl["examples"] >= 2
    skipped = mudpuppy("export", tiny_model_dir, "--format", "gguf", "--out", tmp_path / "c", "--no-eval")
    assert skipped.exit_code == 0 and "perplexity" not in skipped.output


def test_bad_eval_options_end_with_one_clear_message(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    one_error(mudpuppy("export", tiny_model_dir, "--format", "gguf", "--out", out, "--eval-tokens", 0),
              "--eval-tokens 0", "1 or more")
    one_error(mudpuppy("export", tiny_model_dir, "--format", "gguf", "--out", out, "--eval-tokens", -5),
              "--eval-tokens -5")
    one_error(mudpuppy("export", tiny_model_dir, "--format", "gguf", "--out", out, "--eval-data", tmp_path / "no.jsonl"),
              "--eval-data file not found", "no.jsonl")
    one_error(mudpuppy("export", tiny_model_dir, "--format", "gguf", "--out", out, "--eval-data",
                       QUICKSTART_DATA / "smart_home_pref_val.jsonl"),
              "smart_home_pref_val.jsonl: --eval-data holds preference records", "chat")
    one_error(mudpuppy("export", tiny_model_dir, "--format", "merged", "--out", out, "--eval-data", tmp_path / "x"),
              "--eval-data", "--format merged writes none")
    one_error(mudpuppy("export", tiny_model_dir, "--format", "gguf", "--out", out, "--eval-tokens", 100, "--no-eval"),
              "--eval-tokens", "--no-eval")
    words = mudpuppy("export", tiny_model_dir, "--format", "gguf", "--out", out, "--eval-tokens", "many")
    assert words.exit_code == 2 and "Invalid value for '--eval-tokens'" in words.output
    assert not out.exists()
