"""The family x feature matrix of docs/models.md (issue 26, part 6): the cells no other test covers.

One tiny random model per family (hidden 64, 2 layers, 4 heads / 2 KV heads of 16, MoE 4 experts
top 2, the tests' tokenizer), built once per module and saved as a user's model directory, then
driven through mudpuppy's Python API on the torch CPU backend at fp32:

- load: `load_model` gives the model's own logits, with the attention it supports;
- LoRA (all-linear) and DoRA: one step moves the adapter, loss finite; DoRA on fused experts is
  refused by name (PEFT adapts 3-D expert tensors without DoRA);
- QLoRA int4: the base loads quantized (experts too), one step trains, and the loss it trains on
  is the dequantized model's;
- packing: packed logits equal each example alone, with examples longer than the window;
- GRPO sampling: `sample` is reproducible for a seed, and greedy (top_k 1) equals a no-cache
  argmax loop over the model's own forward for both left-padded prompts;
- merge: `merge_and_save` then transformers' loader gives the adapter's logits (1e-4);
- FSDP2: `decoder_layers` finds the family's decoder layer class, and `shard_model` wraps the
  LoRA model in a one-process gloo group with the unsharded logits;
- GGUF for these models (the shapes above, tied heads) where tests/export/test_gguf_families.py
  builds its own: Mistral reads back; SmolLM3, GLM-4 and Cohere export to the tensors and keys
  llama.cpp's loader asks for, and (readers tier, with llama-cpp-python) llama.cpp's logits equal the
  model's; a Mistral or Mixtral with a sliding window exports with a note; what llama.cpp would
  compute differently (the matrix's Qwen2 window, SmolLM3 rotary on other layers than every 4th,
  Cohere q/k norms below 64 layers) is refused naming the alternatives.

Other cells are tested elsewhere (docs/models.md, "The matrix", names them).
"""

from __future__ import annotations

import contextlib
import json
import socket

import numpy as np
import pytest
import torch
import transformers

from mudpuppy import create_backend
from mudpuppy.backends.protocol import Sampling
from mudpuppy.config import AdapterConfig, DistributedConfig, ModelConfig, TrainingConfig
from mudpuppy.data import collate, collate_packed
from mudpuppy.errors import MudpuppyError

from ..conftest import build_tokenizer
from ..conftest import random_examples, randomize_lora
from ..readers.cpp import HAVE_LLAMA_CPP, REASON

WINDOW = 6          # shorter than the examples below, so a sliding window acts
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
              initializer_range=0.2)          # logits wide enough that greedy choices are not near ties
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
ALTERNATING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
# family -> (config class, options beyond COMMON); the shapes of tests/backends/mlx/test_families.py,
# which cannot be imported without mlx.
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, dict(sliding_window=WINDOW)),
    "qwen2": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": (transformers.Qwen3Config, {}),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                                    norm_topk_prob=True)),
    "mixtral": (transformers.MixtralConfig, dict(MOE, sliding_window=WINDOW)),
    "gemma2": (transformers.Gemma2Config, dict(ALTERNATING, final_logit_softcapping=5.0)),
    "gemma3_text": (transformers.Gemma3TextConfig, ALTERNATING),
    "phi3": (transformers.Phi3Config, dict(sliding_window=WINDOW)),
    "granite": (transformers.GraniteConfig, dict(logits_scaling=8.0)),
    "olmo2": (transformers.Olmo2Config, {}),
    # YaRN's original length is 4096: the default positions keep transformers from warning about the factor.
    "gpt_oss": (transformers.GptOssConfig, dict(MOE, **ALTERNATING, max_position_embeddings=131072)),
    "smollm3": (transformers.SmolLM3Config, {}),
    "glm4": (transformers.Glm4Config, {}),
    "cohere": (transformers.CohereConfig, dict(logit_scale=0.0625)),
}
FUSED_EXPERTS = {"qwen3_moe", "mixtral", "gpt_oss"}


def build(family: str, path, tokenizer, **extra):
    """The tiny model of `family` saved with `tokenizer` at `path`."""
    from mudpuppy.backends.torch.model.attention import choose_attention

    config_class, options = FAMILIES[family]
    config = config_class(**{**COMMON, **options, **extra}, vocab_size=len(tokenizer),
                          pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(sorted(FAMILIES).index(family))
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=choose_attention("AutoModelForCausalLM", config)).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and on a shared 2-core runner intra-op threads
    waiting on each other made a KV-cache decode step ~100x slower (4.5 s against 0.03 s for 16 tokens)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def backend():
    return create_backend("cpu", precision="fp32")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """family -> its model directory, built on first use."""
    root = tmp_path_factory.mktemp("families")
    tokenizer = build_tokenizer(root / "tokenizer")
    made = {}

    def get(family, **extra):
        key = (family, tuple(sorted(extra.items())))
        if key not in made:
            made[key] = build(family, root / f"{family}-{len(made)}", tokenizer, **extra)
        return made[key]
    return get


def load(backend, path, adapter: dict | None = None):
    """(handle, AdapterInfo or None): the model loaded for `adapter` and the adapter attached."""
    cfg = AdapterConfig(**{"r": 4, "alpha": 8, **adapter}) if adapter is not None else None
    handle = backend.load_model(ModelConfig(base_model=str(path)), "fp32", adapter=cfg)
    return handle, (backend.attach_adapter(handle, cfg) if cfg is not None else None)


def examples(lengths, seed=0):
    return random_examples(lengths, 300, seed)


def batch_of(lengths=(11, 8), seed=0):
    return collate(examples(lengths, seed), pad_id=0)


def own_logits(model, batch) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(batch.input_ids),
                     attention_mask=torch.as_tensor(batch.attention_mask)).logits.float().numpy()


def one_step(backend, handle, batch, lr=1e-2):
    trainer = backend.create_trainer(handle, TrainingConfig(max_steps=1, micro_batch_size=2, learning_rate=lr,
                                                            precision="fp32"))
    return trainer.step([batch], lr=lr)


def trainable(handle) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in handle.model.named_parameters() if p.requires_grad}


def moved(before: dict, handle) -> set[str]:
    now = dict(handle.model.named_parameters())
    return {n for n, p in before.items() if not torch.equal(p, now[n].detach())}




# ------------------------------------------------------------------ load


@pytest.mark.parametrize("family", list(FAMILIES))
def test_load(backend, model_dirs, family):
    path = model_dirs(family)
    handle, _ = load(backend, path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=handle.model.config._attn_implementation).eval()
    b = batch_of()
    real = b.attention_mask.astype(bool)
    np.testing.assert_allclose(backend.logits(handle, b)[real], own_logits(reference, b)[real], atol=1e-5, rtol=0)
    attention = "eager" if family in ("gemma2", "gpt_oss") else "sdpa"
    assert handle.model.config._attn_implementation == attention
    assert f"{attention} attention" in handle.load_report.describe()


# ------------------------------------------------------------------ LoRA, DoRA, QLoRA


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora(backend, model_dirs, family):
    handle, info = load(backend, model_dirs(family), {"type": "lora"})
    if family in FUSED_EXPERTS:                      # all-linear reaches the fused experts
        assert {"experts.down_proj", "experts.gate_up_proj"} <= set(info.target_modules)
    before = trainable(handle)
    result = one_step(backend, handle, batch_of())
    assert np.isfinite(result.loss) and not result.skipped
    changed = moved(before, handle)
    assert any("lora_B" in n for n in changed), f"{family}: the step left the adapter as it was"
    assert not any("lora_" not in n for n in changed)          # the base stays frozen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dora(backend, model_dirs, family):
    if family in FUSED_EXPERTS:
        with pytest.raises(MudpuppyError) as refused:
            load(backend, model_dirs(family), {"type": "dora"})
        message = str(refused.value)
        assert "DoRA" in message and "experts are fused tensors" in message
        assert "adapter.type lora" in message and "without the experts" in message
        return
    handle, _ = load(backend, model_dirs(family), {"type": "dora"})
    magnitudes = [n for n, p in handle.model.named_parameters() if "lora_magnitude_vector" in n and p.requires_grad]
    assert magnitudes
    before = trainable(handle)
    result = one_step(backend, handle, batch_of())
    assert np.isfinite(result.loss) and not result.skipped
    changed = moved(before, handle)
    assert any("lora_B" in n for n in changed) and any("magnitude" in n for n in changed)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_qlora(backend, model_dirs, family):
    from mudpuppy.backends.torch.model.experts import PackedExperts
    from mudpuppy.backends.torch.quantization.linear4bit import Linear4bit, dequantize_model

    handle, info = load(backend, model_dirs(family), {"type": "qlora", "quant_backend": "int4"})
    assert any(isinstance(m, Linear4bit) for m in handle.model.modules())
    if family in FUSED_EXPERTS:
        assert any(isinstance(p, PackedExperts) for p in handle.model.parameters())
        assert "expert tensors" in info.quantization
    b = batch_of()
    before = trainable(handle)
    result = one_step(backend, handle, b)
    assert np.isfinite(result.loss) and not result.skipped
    assert any("lora_B" in n for n in moved(before, handle))
    with torch.no_grad():
        quantized, n = backend.loss_sum(handle, b)
    # The loss QLoRA trains on is the dequantized model's: the 4-bit codes are the weights.
    assert dequantize_model(handle.model) > 0
    assert not any(isinstance(m, Linear4bit) for m in handle.model.modules())
    with torch.no_grad():
        dense, _ = backend.loss_sum(handle, b)
    assert float(quantized) / n == pytest.approx(float(dense) / n, rel=1e-5, abs=1e-6)


# ------------------------------------------------------------------ packing


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packing(backend, model_dirs, family):
    handle, _ = load(backend, model_dirs(family))
    exs = examples([11, 17, 8, 13], seed=1)                   # each longer than the window
    packed = collate_packed([exs[:2], exs[2:]], pad_id=0)
    got = backend.logits(handle, packed)
    for row, group in enumerate((exs[:2], exs[2:])):
        at = 0
        for ex in group:
            alone = own_logits(handle.model, collate([ex], pad_id=0))[0]
            np.testing.assert_allclose(got[row, at: at + len(ex)], alone, atol=1e-5, rtol=1e-5)
            at += len(ex)


# ------------------------------------------------------------------ GRPO sampling


def greedy_without_cache(model, prompt: list[int], n: int, stop: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            token = int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax())
            ids.append(token)
            if token == stop:
                break
    return ids[len(prompt):]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_grpo_sampling(backend, model_dirs, family):
    handle, _ = load(backend, model_dirs(family), {"type": "lora"})
    randomize_lora(handle.model)                     # a policy that is not the base
    stop = handle.tokenizer.eos_token_id
    # left-padded together; the repeated prompt is prefilled once and its cache shared (sampling.shared_prefill)
    prompts = [[5, 17, 42, 99, 7], [8, 150, 33, 61, 12, 200, 9, 77, 41], [5, 17, 42, 99, 7]]
    warm = Sampling(temperature=1.0)
    first = backend.sample(handle, prompts, 8, [stop], warm, seed=7)
    assert len(first) == 3 and all(0 < len(row) <= 8 for row in first)
    assert backend.sample(handle, prompts, 8, [stop], warm, seed=7) == first
    assert backend.sample(handle, prompts, 8, [stop], warm, seed=8) != first
    greedy = backend.sample(handle, prompts, 8, [stop], Sampling(top_k=1), seed=7)
    handle.model.eval()
    assert greedy == [greedy_without_cache(handle.model, p, 8, stop) for p in prompts]


# ------------------------------------------------------------------ merge


@pytest.mark.parametrize("family", list(FAMILIES))
def test_merge(backend, model_dirs, family, tmp_path):
    path = model_dirs(family)
    handle, _ = load(backend, path, {"type": "lora"})
    randomize_lora(handle.model)
    b = batch_of()
    real = b.attention_mask.astype(bool)
    adapted = backend.logits(handle, b)
    attention = handle.model.config._attn_implementation
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation=attention).eval()
    assert np.abs(own_logits(base, b) - adapted)[real].max() > 1e-3      # the adapter changes the logits
    backend.merge_and_save(handle, str(tmp_path / "merged"), dtype="float32")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                               attn_implementation=attention).eval()
    np.testing.assert_allclose(own_logits(merged, b)[real], adapted[real], atol=1e-4, rtol=0)


# ------------------------------------------------------------------ FSDP2 wrapping


@contextlib.contextmanager
def one_process_group():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fsdp2_wrapping(backend, model_dirs, family):
    from mudpuppy.backends.torch.distributed import Step, decoder_layers, shard_model

    handle, _ = load(backend, model_dirs(family), {"type": "lora"})
    randomize_lora(handle.model)
    model = handle.model
    layers = decoder_layers(model)
    base = model.get_base_model()
    assert layers == list(base.model.layers)
    assert {type(layer).__name__ for layer in layers} <= set(base._no_split_modules)   # the decoder layer class
    b = batch_of()
    expected = own_logits(model, b)
    with one_process_group():
        wrapped = shard_model(Step(model), model, None, DistributedConfig(strategy="fsdp"))
        from torch.distributed.fsdp import FSDPModule

        assert all(isinstance(layer, FSDPModule) for layer in layers)
        got = wrapped(lambda: model(input_ids=torch.as_tensor(b.input_ids),
                                    attention_mask=torch.as_tensor(b.attention_mask)).logits)
        loss = got.float().logsumexp(-1).mean()
        loss.backward()                              # gradients reach the sharded LoRA matrices
        grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
        assert grads and all(g is not None for g in grads)
    real = b.attention_mask.astype(bool)
    np.testing.assert_allclose(got.detach().float().numpy()[real], expected[real], atol=1e-5, rtol=0)


# ------------------------------------------------------------------ GGUF, the families test_gguf_families leaves out


def test_gguf_mistral_reads_back(model_dirs, tmp_path):
    """Mistral without a sliding window is llama to llama.cpp (with one it is refused: test below)."""
    from mudpuppy.export import ExportRequest, export_model

    path = model_dirs("mistral", sliding_window=None)
    export_model(ExportRequest(str(path), "gguf", str(tmp_path / "gguf"), quant="f32"), echo=lambda *_a, **_k: None)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", gguf_file="model-f32.gguf",
                                                             dtype=torch.float32).eval()
    source = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    b = batch_of((11,))
    np.testing.assert_allclose(own_logits(back, b), own_logits(source, b), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["mistral", "mixtral"])
def test_gguf_says_where_a_dropped_window_changes_answers(model_dirs, tmp_path, family):
    """llama.cpp runs Mistral and Mixtral as llama, without their sliding window (its own converter drops it
    too): the export goes on, and says so at export and in export.json, never silently."""
    from click.testing import CliRunner

    from mudpuppy.cli import main

    done = CliRunner().invoke(main, ["export", str(model_dirs(family)), "--format", "gguf", "--quant", "f32",
                                     "--out", str(tmp_path / "out")])
    assert done.exit_code == 0, done.output
    said = f"without its sliding window of {WINDOW} tokens"
    assert f"note: llama.cpp runs this model as llama, {said}" in done.output
    record = json.loads((tmp_path / "out" / "export.json").read_text())
    assert any(said in note for note in record["gguf"]["notes"])
    if family == "mistral":        # read back: equal up to the window, different past it (what the note says)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model-f32.gguf",
                                                                 dtype=torch.float32).eval()
        source = transformers.AutoModelForCausalLM.from_pretrained(model_dirs(family), dtype=torch.float32).eval()
        b = batch_of((11,))
        got, want = own_logits(back, b), own_logits(source, b)
        np.testing.assert_allclose(got[:, :WINDOW], want[:, :WINDOW], atol=1e-4, rtol=0)
        assert np.abs(got[:, WINDOW:] - want[:, WINDOW:]).max() > 1e-2


LLAMA_CPP_FAMILIES = ["smollm3", "glm4", "cohere"]      # the matrix's shapes, here only


def export_gguf(path, out) -> "object":
    from click.testing import CliRunner

    from mudpuppy.cli import main

    return CliRunner().invoke(main, ["export", str(path), "--format", "gguf", "--quant", "f32", "--out", str(out)])


@pytest.mark.parametrize("family", LLAMA_CPP_FAMILIES)
def test_gguf_is_what_llama_cpp_loads(model_dirs, tmp_path, family):
    """The tensors (shapes) and metadata llama.cpp's loader reads for the arch, transcribed from its
    src/models/<arch>.cpp in tests/export/test_gguf_families.py."""
    import gguf

    from ..export.test_gguf_families import ARCH, llama_cpp_keys, llama_cpp_tensors

    path = model_dirs(family)
    done = export_gguf(path, tmp_path / "out")
    assert done.exit_code == 0, done.output
    c = json.loads((path / "config.json").read_text())
    reader = gguf.GGUFReader(str(tmp_path / "out" / "model-f32.gguf"))
    arch = reader.fields["general.architecture"].contents()
    assert arch == ARCH[family]
    assert {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors} == llama_cpp_tensors(family, c)
    for key, value in llama_cpp_keys(family, c).items():
        field = reader.fields.get(f"{arch}.{key}")
        assert field is not None, key
        assert field.contents() == (value if isinstance(value, str) else pytest.approx(value, rel=1e-6)), key


@pytest.mark.readers
@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason=REASON)
@pytest.mark.parametrize("family", LLAMA_CPP_FAMILIES)
def test_gguf_llama_cpp_logits_equal_the_model(model_dirs, tmp_path, family):
    import llama_cpp

    path = model_dirs(family)
    assert export_gguf(path, tmp_path / "out").exit_code == 0
    llm = llama_cpp.Llama(model_path=str(tmp_path / "out" / "model-f32.gguf"), n_ctx=64, logits_all=True,
                          type_k=0, type_v=0, verbose=False)           # GGML_TYPE_F32 cache
    ids = examples((11,))[0].input_ids.tolist()
    llm.eval(ids)
    source = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = source(input_ids=torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(llm.scores[:len(ids)]), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family,extra,named", [
    ("qwen2", {}, "use_sliding_window: true"),                 # this matrix's Qwen2 slides its window
    ("smollm3", {"no_rope_layer_interval": 2}, "no_rope_layers [1, 0]"),       # no rotary on the 2nd layer
    ("cohere", {"use_qk_norm": True}, "use_qk_norm: true with 2 layers"),
], ids=["qwen2-sliding_window", "smollm3-no_rope_layers", "cohere-qk_norm"])
def test_gguf_refused(model_dirs, tmp_path, family, extra, named):
    """What llama.cpp's graph for the family would compute differently: one message naming the setting and
    the alternatives, exit 2, nothing written."""
    done = export_gguf(model_dirs(family, **extra), tmp_path / "out")
    assert done.exit_code == 2, done.output
    assert named in done.output and "--format merged" in done.output and "--format mlx" in done.output
    assert "Traceback" not in done.output and not (tmp_path / "out").exists()
