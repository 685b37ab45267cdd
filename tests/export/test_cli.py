"""`mudpuppy export` from the command line: a merged run equals PEFT's merge, earlier work is protected,
and every bad input ends with one message and exit code 2."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ..conftest import build_tokenizer
from .conftest import mudpuppy


def one_error(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output
    for needle in needles:
        assert needle in result.output, result.output


def test_a_merged_export_of_a_run_equals_the_peft_merge_and_is_protected(lora_run, peft_merged, tmp_path):
    from safetensors.numpy import load_file

    out = tmp_path / "merged"
    done = mudpuppy("export", lora_run, "--format", "merged", "--out", out, "--dtype", "fp32")
    assert done.exit_code == 0, done.output
    model, tok = peft_merged
    weights = load_file(str(out / "model.safetensors"))
    for name, value in model.state_dict().items():
        if name in weights:
            np.testing.assert_allclose(weights[name], value.numpy(), atol=1e-6, rtol=0)
    assert "model.layers.0.self_attn.q_proj.weight" in weights and not any("lora" in k for k in weights)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["rope_theta"] > 0
    record = json.loads((out / "export.json").read_text())
    assert record["format"] == "merged" and record["dtype"] == "float32" and "model.safetensors" in record["files"]
    assert (out / "chat_template.jinja").read_text() == tok.chat_template

    one_error(mudpuppy("export", lora_run, "--format", "merged", "--out", out), "--overwrite")
    again = mudpuppy("export", lora_run, "--format", "merged", "--out", out, "--dtype", "bf16", "--overwrite")
    assert again.exit_code == 0, again.output
    assert json.loads((out / "export.json").read_text())["dtype"] == "bfloat16"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]      # no staging left behind

    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("mine")
    one_error(mudpuppy("export", lora_run, "--format", "gguf", "--out", foreign, "--overwrite"), "refusing")
    assert (foreign / "todo.txt").read_text() == "mine"


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A tiny GPT-2: a causal LM the GGUF writer does not map."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("gpt2")
    tok = build_tokenizer(path)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def test_bad_inputs_end_with_one_clear_message(tiny_model_dir, gpt2_dir, tmp_path):
    out = tmp_path / "out"
    bad_format = mudpuppy("export", tiny_model_dir, "--format", "onnx", "--out", out)
    assert bad_format.exit_code == 2 and "Invalid value for '--format'" in bad_format.output
    one_error(mudpuppy("export", gpt2_dir, "--format", "gguf", "--out", out),
              "GPT2LMHeadModel", "supported architectures: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM")
    one_error(mudpuppy("export", tiny_model_dir, "--format", "gguf", "--out", out, "--quant", "q5_1"),
              "q8_0", "q4_k_m")
    one_error(mudpuppy("export", tiny_model_dir, "--format", "gguf", "--out", out, "--dtype", "fp16"), "--quant")
    one_error(mudpuppy("export", tiny_model_dir, "--format", "merged", "--out", out, "--quant", "q8_0"), "--dtype")
    one_error(mudpuppy("export", tiny_model_dir, "--format", "mlx", "--out", out, "--quant", "q3"), "q4, q8")
    one_error(mudpuppy("export", tmp_path / "missing", "--format", "gguf", "--out", out), "no such file")
    one_error(mudpuppy("export", tiny_model_dir, "--format", "ollama", "--out", out, "--chat-template", "nope"),
              "--chat-template")
    assert not out.exists()


def test_k_quants_are_written_without_llama_quantize(tiny_model_dir, tmp_path):
    """K-quants are written in Python (export/kquants.py): nothing on PATH is needed or called. The tiny
    model's rows (32) fit no 256-value block, so every matrix takes llama.cpp's fallback type."""
    empty = tmp_path / "bin-empty"
    empty.mkdir()
    out = tmp_path / "k"
    done = mudpuppy_with_path(str(empty), "export", tiny_model_dir, "--format", "gguf", "--out", out,
                              "--quant", "Q4_K_M")
    assert done.exit_code == 0, done.output
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "export.json", "model-q4_k_m.gguf"]
    import gguf

    reader = gguf.GGUFReader(str(out / "model-q4_k_m.gguf"))
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert {t.tensor_type.name for t in reader.tensors} == {"F32", "Q5_0", "Q8_0"}


def mudpuppy_with_path(path: str, *args):
    from click.testing import CliRunner

    from mudpuppy.cli import main

    return CliRunner(env={"PATH": path}).invoke(main, [str(a) for a in args])


def test_ollama_defaults_to_q4_k_m_and_imatrix_weights_the_blocks(tiny_model_dir, tmp_path):
    """Ollama's library ships Q4_K_M, so an export without --quant writes it; --imatrix FILE (llama-imatrix's
    GGUF form) reaches the block search: skewed column weights change the quantized bytes, and the record
    says how many tensors used them."""
    import gguf

    from mudpuppy.export.imatrix import Stats, write_imatrix

    plain = tmp_path / "plain"
    done = mudpuppy("export", tiny_model_dir, "--format", "ollama", "--out", plain, "--chat-template", "chatml")
    assert done.exit_code == 0, done.output
    assert (plain / "model-q4_k_m.gguf").is_file() and "model-q4_k_m.gguf" in (plain / "Modelfile").read_text()
    reader = gguf.GGUFReader(str(plain / "model-q4_k_m.gguf"))
    quantized = {t.name: t for t in reader.tensors if t.tensor_type.name not in ("F32", "F16")}
    assert quantized
    rng = np.random.default_rng(0)
    stats = {name: Stats(rng.uniform(0.0, 50.0, size=(1, int(t.shape[0]))) ** 3, np.asarray([64]))
             for name, t in quantized.items()}
    matrix = tmp_path / "imatrix.gguf"
    write_imatrix(matrix, stats, ["calibration.jsonl"], chunk_count=4, chunk_size=16)
    weighted = tmp_path / "weighted"
    done = mudpuppy("export", tiny_model_dir, "--format", "gguf", "--quant", "q4_k_m", "--imatrix", matrix,
                    "--out", weighted)
    assert done.exit_code == 0, done.output
    assert f"importance matrix: {matrix} ({len(stats)} tensors, 4 chunks)" in done.output
    record = json.loads((weighted / "export.json").read_text())["gguf"]
    assert record["imatrix_tensors"] == len(quantized)
    after = {t.name: bytes(t.data) for t in gguf.GGUFReader(str(weighted / "model-q4_k_m.gguf")).tensors}
    assert any(after[name] != bytes(t.data) for name, t in quantized.items())


def test_a_bad_imatrix_is_refused_before_any_weights(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    one_error(mudpuppy("export", tiny_model_dir, "--format", "gguf", "--out", out, "--imatrix", tmp_path / "no.dat",
                       "--quant", "q4_k_m"), "--imatrix", "no such file")
    one_error(mudpuppy("export", tiny_model_dir, "--format", "gguf", "--out", out, "--imatrix", tmp_path / "no.dat"),
              "--imatrix weights GGUF K-quants", "--quant f16")
    one_error(mudpuppy("export", tiny_model_dir, "--format", "merged", "--out", out, "--imatrix", tmp_path / "x"),
              "--imatrix")
    assert not out.exists()
