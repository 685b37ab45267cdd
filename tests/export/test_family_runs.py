"""A quickstart-sized run of a non-Llama family goes from `mudpuppy run` through `mudpuppy export
--format gguf` and `--format mlx` with nothing from the user beyond the config (issue 26's "done when").

Gemma 3 (sliding-window layers, packed) and Qwen3-MoE (fused experts, which all-linear adapts) as tiny
random models; the commands are the real CLI. Each export is read back: the GGUF by transformers'
GGUF loader, the MLX directory by mlx-lm, both against the merged model's logits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from mudpuppy.cli import main

from ..conftest import tiny_run_config
from .test_gguf_families import build

TEXT = "turn on the kitchen lights and then switch off the bedroom fan please"


def invoke(*args):
    result = CliRunner().invoke(main, [*map(str, args)])
    assert result.exit_code == 0, result.output + (repr(result.exception) if result.exception else "")
    return result


@pytest.fixture(scope="module", params=["gemma3", "qwen3moe"])
def trained(request, tmp_path_factory):
    """(family, run directory, merged model directory) after a 3-step packed LoRA run."""
    family = request.param
    root = tmp_path_factory.mktemp(f"run-{family}")
    # Gemma 3's layout (sliding layers, every N-th global) at 2 layers: mlx-lm's gemma3_text needs one global
    extra = {"layer_types": ["sliding_attention", "full_attention"]} if family == "gemma3" else {}
    build(family, root / "base", **extra)
    cfg = tiny_run_config(root / "base", root / "run")
    cfg["data"].update(packing=True, sequence_len=64, cache=False)
    cfg["training"].update(max_steps=3, micro_batch_size=2)
    cfg["eval"] = {"before_training": False, "after_training": False}
    (root / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    out = invoke("run", "--config", root / "cfg.yaml").output
    if family == "qwen3moe":        # all-linear reached the fused experts (the adapter line counts them)
        assert "experts" in out.split("adapter:", 1)[1].splitlines()[0], out
    # The run log says how the weights loaded and which attention the family got (Gemma 3: SDPA, its
    # sliding layers' windows composed with the packing mask).
    model_line = out.split("model: ", 1)[1].splitlines()[0]
    assert model_line.startswith("loaded ") and model_line.endswith(", sdpa attention"), out
    invoke("export", root / "run", "--format", "merged", "--dtype", "fp32", "--out", root / "merged")
    return family, root / "run", root / "merged"


def merged_logits(merged, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_the_run_exports_to_gguf_and_reads_back(trained, tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    family, run, merged = trained
    invoke("export", run, "--format", "gguf", "--quant", "f32", "--out", tmp_path / "gguf")
    files = list((tmp_path / "gguf").glob("*.gguf"))
    assert len(files) == 1
    ids = AutoTokenizer.from_pretrained(str(merged))(TEXT)["input_ids"]
    config = AutoConfig.from_pretrained(str(tmp_path / "gguf"), gguf_file=files[0].name)
    if family == "gemma3":
        # transformers' GGUF reader ignores gemma3.attention.sliding_window_pattern (llama.cpp reads it):
        # check the pattern in the file, then read the tensors back under the model's own layer types
        import gguf

        field = gguf.GGUFReader(str(files[0])).fields["gemma3.attention.sliding_window_pattern"]
        layer_types = AutoConfig.from_pretrained(str(merged)).layer_types
        assert [bool(field.parts[i][0]) for i in field.data] == [t == "sliding_attention" for t in layer_types]
        config.layer_types = layer_types
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "gguf"), gguf_file=files[0].name, config=config,
                                                dtype=torch.float32).eval()
    with torch.no_grad():
        got = back(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(got, merged_logits(merged, ids), atol=1e-4, rtol=0)


@pytest.mark.mlx
def test_the_run_exports_to_mlx_and_mlx_lm_reads_it(trained, tmp_path):
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx_lm import load
    from transformers import AutoTokenizer

    family, run, merged = trained
    invoke("export", run, "--format", "mlx", "--dtype", "fp32", "--out", tmp_path / "mlx")
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert config["model_type"] in ("gemma3_text", "qwen3_moe")
    # The dtype its weights are stored in, and a KV cache for whoever generates with it.
    assert config["dtype"] == "float32" and config["use_cache"] is True and "torch_dtype" not in config
    ids = AutoTokenizer.from_pretrained(str(merged))(TEXT)["input_ids"]
    model, _ = load(str(tmp_path / "mlx"))
    got = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    np.testing.assert_allclose(got, merged_logits(merged, ids), atol=1e-4, rtol=0)


def test_what_the_run_and_its_merge_write_loads_elsewhere(trained):
    """Tokenizer files name a class transformers 4.x loads too (5.x would write TokenizersBackend), with
    the same ids; the merged config.json generates with a KV cache (training loaded it off)."""
    from transformers import AutoTokenizer

    _, run, merged = trained
    written = [w for w in (run, run / "adapter", merged) if (w / "tokenizer_config.json").is_file()]
    assert merged in written and len(written) >= 2, written
    for where in written:
        assert json.loads((where / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
        assert AutoTokenizer.from_pretrained(str(where))(TEXT)["input_ids"] == \
            AutoTokenizer.from_pretrained(str(run.parent / "base"))(TEXT)["input_ids"]
    assert json.loads((merged / "config.json").read_text())["use_cache"] is True
