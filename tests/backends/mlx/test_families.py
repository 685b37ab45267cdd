"""Every family mlx-lm has, on the MLX backend: loading, one LoRA step, export (issue 26 part 5).

Tiny random models of each family (hidden 64, 2 layers, the tests' tokenizer; MoE 4 experts,
top 2), saved by transformers 5 as a user's model directory. Per family: mudpuppy's MLX
loader gives torch's fp32 logits (1e-4) on a padded batch longer than the sliding window
where the family has one; one LoRA step changes the adapter; `mudpuppy export --format mlx`
writes a directory `mlx_lm.load` reads back with the same logits. A family mlx-lm lacks, or
computes differently, is refused by name before the weights load.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
import yaml

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mudpuppy.config import AdapterConfig, TrainingConfig
from mudpuppy.data import Example, collate
from mudpuppy.errors import MudpuppyError
from mudpuppy.export import ExportRequest, export_model

from ...conftest import build_tokenizer, tiny_run_config
from .conftest import model_cfg

pytestmark = pytest.mark.mlx

WINDOW = 6          # shorter than the rows below, so a sliding window acts
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
              pad_token_id=0, bos_token_id=0, eos_token_id=2)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
ALTERNATING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
# family -> (config class, extra config, embedding scale: 40 where soft-capping or scaling must act)
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}, 1.0),
    "mistral": (transformers.MistralConfig, dict(sliding_window=WINDOW), 1.0),
    "qwen2": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), 1.0),
    "qwen3": (transformers.Qwen3Config, {}, 1.0),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                    norm_topk_prob=True), 1.0),
    "mixtral": (transformers.MixtralConfig, dict(MOE, sliding_window=WINDOW), 1.0),
    "gemma2": (transformers.Gemma2Config, dict(ALTERNATING, final_logit_softcapping=5.0), 40.0),
    "gemma3_text": (transformers.Gemma3TextConfig, ALTERNATING, 1.0),
    "phi3": (transformers.Phi3Config, dict(sliding_window=WINDOW), 1.0),
    "granite": (transformers.GraniteConfig, dict(logits_scaling=8.0), 40.0),
    "olmo2": (transformers.Olmo2Config, {}, 1.0),
    "gpt_oss": (transformers.GptOssConfig, dict(**MOE, **ALTERNATING, max_position_embeddings=131072,
                                                tie_word_embeddings=False), 1.0),
    "smollm3": (transformers.SmolLM3Config, {}, 1.0),
    "glm4": (transformers.Glm4Config, {}, 1.0),       # tied: mlx-lm's GLM-4 always has its own head
    "cohere": (transformers.CohereConfig, dict(logit_scale=0.0625), 40.0),
}
MOE_FAMILIES = {"qwen3_moe", "mixtral", "gpt_oss"}
# Families whose mlx-lm model leaves out the window: an mlx_lm.load of the export is exact up to it.
WINDOW_LEFT_OUT = {"mistral", "qwen2", "mixtral", "gemma2", "phi3"}


def build(family: str, path):
    from mudpuppy.backends.torch.model.attention import choose_attention

    config_class, extra, scale = FAMILIES[family]
    tok = build_tokenizer(path)
    config = config_class(**{**COMMON, "vocab_size": len(tok), **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=choose_attention("AutoModelForCausalLM", config))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(scale)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            made[family] = build(family, tmp_path_factory.mktemp(family))
        return made[family]
    return get


def batch(lengths=(11, 8)):
    rng = np.random.default_rng(0)
    examples = []
    for n in lengths:
        mask = np.ones(n, dtype=bool)
        mask[: n // 3] = False
        examples.append(Example(rng.integers(3, 300, n).astype(np.int32), mask))
    return collate(examples, pad_id=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mlx_logits_equal_torch_and_one_lora_step_trains(family, model_dirs, mlx_backend, torch_backend):
    path = model_dirs(family)
    b = batch()
    t = torch_backend.load_model(model_cfg(path), "fp32")
    expected = torch_backend.logits(t, b)
    m = mlx_backend.load_model(model_cfg(path), "fp32")
    got = mlx_backend.logits(m, b)
    real = b.attention_mask.astype(bool)
    diff = float(np.abs(got - expected)[real].max())
    assert diff < 1e-4, f"{family}: MLX logits {diff:.2e} from torch's"
    assert m.split_head and m.masks          # the chunked-head loss path and exact masks both hold

    targets = ["q_proj", "v_proj"] if family in MOE_FAMILIES else "all-linear"
    mlx_backend.attach_adapter(m, AdapterConfig(type="lora", r=4, alpha=8, target_modules=targets))
    before = {k: np.array(v) for k, v in _flat(m.model.trainable_parameters())}
    trainer = mlx_backend.create_trainer(m, TrainingConfig(max_steps=1, learning_rate=1e-2))
    result = trainer.step([b], 1e-2)
    assert np.isfinite(result.loss) and result.loss_tokens == int((b.labels != -100).sum())
    after = dict(_flat(m.model.trainable_parameters()))
    moved = [k for k, v in before.items() if not np.array_equal(v, np.array(after[k]))]
    assert any(k.endswith("lora_b") for k in moved), f"{family}: the step left the adapter as it was"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_mlx_export_reads_back_in_mlx_lm_with_torchs_logits(family, model_dirs, tmp_path):
    from mlx_lm import load

    path = model_dirs(family)
    out = tmp_path / "mlx"
    result = export_model(ExportRequest(str(path), "mlx", str(out), dtype="fp32", backend="cpu"),
                          echo=lambda *_a, **_k: None)
    # Within the window where mlx-lm leaves it out (the record says so), the whole row elsewhere.
    n = WINDOW if family in WINDOW_LEFT_OUT else 11
    ids = np.random.default_rng(1).integers(3, 300, (1, n))
    model, _ = load(str(out))
    got = np.array(model(mx.array(ids)).astype(mx.float32))
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch_model(torch.as_tensor(ids)).logits.numpy()
    diff = float(np.abs(got - expected).max())
    assert diff < 1e-4, f"{family}: the export's logits {diff:.2e} from torch's"
    notes = result.record["mlx"].get("notes", [])
    assert any("sliding window" in n for n in notes) == (family in WINDOW_LEFT_OUT), notes
    assert any("YaRN" in n for n in notes) == (family == "gpt_oss"), notes     # truncate: false
    assert "rope_theta" in json.loads((out / "config.json").read_text())


def test_moe_all_linear_on_a_family_whose_experts_mlx_cannot_adapt_is_refused_by_name(model_dirs, mlx_backend):
    # Qwen3-MoE, Mixtral and gpt-oss adapt their experts on MLX (test_moe_lora.py); an MoE family
    # outside experts.SPLITS is refused by name rather than trained on its attention alone.
    from mudpuppy.backends.mlx import experts

    m = mlx_backend.load_model(model_cfg(model_dirs("qwen3_moe")), "fp32")
    m.config = {**m.config, "model_type": "olmoe"}
    assert "olmoe" not in experts.SPLITS
    with pytest.raises(MudpuppyError, match="all-linear on olmoe: its experts .* torch backend"):
        mlx_backend.attach_adapter(m, AdapterConfig(type="lora", r=4, target_modules="all-linear"))


def refused_dir(tmp_path, config: dict):
    """A model directory whose one tensor fits no model: a refusal must come before any weight loads."""
    from safetensors.numpy import save_file

    tmp_path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"not.a.weight": np.zeros(1, np.float32)}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_a_family_mlx_lm_lacks_is_refused_by_name_before_loading(tmp_path, mlx_backend):
    from click.testing import CliRunner

    from mudpuppy.cli import main

    config = transformers.OPTConfig(hidden_size=64, num_hidden_layers=2, vocab_size=320).to_dict()
    path = refused_dir(tmp_path / "opt", config)
    with pytest.raises(MudpuppyError, match=r"the opt family .* not in the installed mlx-lm .* torch backend"):
        mlx_backend.load_model(model_cfg(path), "fp32")
    # The same through the CLI: one message, exit 2.
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_run_config(path, tmp_path / "run")))
    res = CliRunner().invoke(main, ["run", "--backend", "mlx", "--config", str(cfg)])
    assert res.exit_code == 2, res.output
    assert "the opt family" in res.output and "torch backend" in res.output and "Traceback" not in res.output


def test_gemma3_that_mlx_lm_cannot_match_is_refused_by_name(tmp_path, mlx_backend):
    base = transformers.Gemma3TextConfig(**{**COMMON, "vocab_size": 320}).to_dict()
    capped = refused_dir(tmp_path / "capped", {**base, **ALTERNATING, "final_logit_softcapping": 30.0})
    with pytest.raises(MudpuppyError, match="Gemma 3 \\(text\\) on MLX: mlx-lm's gemma3_text applies no logit soft"):
        mlx_backend.load_model(model_cfg(capped), "fp32")
    # Two sliding layers and no full one: not mlx-lm's "every N-th layer is global" pattern.
    window_only = refused_dir(tmp_path / "all-sliding", {**base, "layer_types": ["sliding_attention"] * 2})
    with pytest.raises(MudpuppyError, match="Gemma 3 \\(text\\) on MLX: .* every N layers"):
        mlx_backend.load_model(model_cfg(window_only), "fp32")


def _flat(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_decoding_past_the_window_keeps_it(family, model_dirs, mlx_backend):
    """A prompt, then one token at a time through the model's KV cache, well past the window that
    mlx-lm leaves out: each step's logits are torch's for the whole sequence."""
    from mlx_lm.models.cache import make_prompt_cache

    path = model_dirs(family)
    ids = np.random.default_rng(2).integers(3, 300, (1, 3 * WINDOW))
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch_model(torch.as_tensor(ids)).logits.numpy()[0]
    model = mlx_backend.load_model(model_cfg(path), "fp32").model
    cache = make_prompt_cache(model)
    steps = [model(mx.array(ids[:, :4]), cache=cache)[0]]
    steps += [model(mx.array(ids[:, i : i + 1]), cache=cache)[0] for i in range(4, ids.shape[1])]
    got = np.concatenate([np.array(s.astype(mx.float32)) for s in steps])
    assert np.abs(got - expected).max() < 1e-4


def test_yarn_frequencies_are_transformers_whatever_truncate_says(model_dirs, mlx_backend):
    """mlx-lm's YarnRoPE rounds the correction range (transformers' truncate: true); gpt-oss says false.
    families.yarn_parameters is transformers' computation, and the loaded model's ropes use it."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from mudpuppy.backends.mlx.families import yarn_frequencies_rounded, yarn_parameters

    path = model_dirs("gpt_oss")
    config = transformers.AutoConfig.from_pretrained(str(path))
    raw = json.loads((path / "config.json").read_text())
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    got, got_factor = yarn_parameters(raw, config.head_dim)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-6)
    assert got_factor == pytest.approx(factor)
    moved, total = yarn_frequencies_rounded(raw)
    assert 0 < moved < total == config.head_dim // 2
    rounded = {**raw, "rope_parameters": {**raw["rope_parameters"], "truncate": True}}
    assert yarn_frequencies_rounded(rounded) is None       # where mlx-lm already agrees, nothing is reported
    from mlx_lm.models.rope_utils import YarnRoPE

    m = mlx_backend.load_model(model_cfg(path), "fp32")
    ropes = [r for _, r in m.model.named_modules() if isinstance(r, YarnRoPE)]
    assert ropes and all(np.allclose(1 / np.array(r._freqs), expected.numpy(), rtol=1e-6) for r in ropes)

