"""GRPO on torch, end to end on the tiny model: sampling, the trained ids, runs, logs and exact resume.

The maths (loss, gradient, advantages, per-token log-probs) is checked against
TRL in test_grpo_oracle.py; this file checks the pieces around it.
"""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest
import torch
import yaml
from safetensors.numpy import load_file

from mudpuppy import create_backend, load_config, run
from mudpuppy.backends.protocol import Sampling
from mudpuppy.config import ModelConfig
from mudpuppy.errors import ConfigError, MudpuppyError
from mudpuppy.training.rollout import RolloutBatcher, completion_batch

from ..conftest import QUICKSTART_DATA
from ..faults import kill_after
from .test_resume import cli

RL_DATA = QUICKSTART_DATA / "sample_rl.jsonl"


@pytest.fixture(scope="module")
def backend():
    return create_backend("cpu")


@pytest.fixture(scope="module")
def handle(backend, tiny_model_dir):
    return backend.load_model(ModelConfig(base_model=str(tiny_model_dir)), "fp32")


def grpo_config(tiny_config, out, **grpo) -> dict:
    cfg = dict(tiny_config, method="grpo", output_dir=str(out))
    cfg["data"] = {"datasets": [{"path": str(RL_DATA)}], "sequence_len": 64}
    cfg["adapter"] = {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0}
    cfg["training"] = dict(tiny_config["training"], max_steps=4, micro_batch_size=4, learning_rate=5e-2,
                           warmup_steps=0)
    cfg["eval"] = {"before_training": False, "after_training": False}
    cfg["grpo"] = {"num_generations": 4, "max_completion_length": 6, "reward_funcs": [{"length": {"target": 12, "unit": "chars"}}, "exact_match"],
                   **grpo}
    return cfg


# --------------------------------------------------------------------------- sampling

def test_sampling_is_seeded_and_leaves_the_global_rng_alone(backend, handle):
    prompts = [[5, 6, 7], [8, 9]]
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = backend.sample(handle, prompts, 8, [0], Sampling(), seed=7)
    after = torch.rand(3)
    b = backend.sample(handle, prompts, 8, [0], Sampling(), seed=7)
    c = backend.sample(handle, prompts, 8, [0], Sampling(), seed=8)
    torch.testing.assert_close(before, after)     # the draw did not move dropout's random state
    assert a == b and a != c
    assert all(0 < len(row) <= 8 for row in a)


def test_the_output_head_reads_a_contiguous_input_while_generating(backend, handle):
    """The prefill's last position is a strided view; a non-contiguous input makes torch.matmul copy
    the head's weight once per row (benchmarks/grpo_cpu.py measured 1.5 s of a 7.7 s sampling call)."""
    seen = []
    head = handle.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].is_contiguous()))
    try:
        backend.sample(handle, [[5, 6, 7], [8, 9, 10, 11]], 3, [], Sampling(), seed=1)
        backend.generate(handle, [[5, 6, 7], [8, 9, 10, 11]], 3, [])
    finally:
        hook.remove()
    assert seen and all(seen)
    assert not head._forward_pre_hooks               # and the model is left as it was


def test_repeated_prompts_are_prefilled_once_and_sample_what_a_full_prefill_samples(backend, handle, monkeypatch):
    """A GRPO group repeats its prompt num_generations times: the prompt is run once per distinct prompt
    (its cache repeated to the group's rows) and the draws are those of every row prefilled on its own,
    for per-row seeds and one seed, with left padding (prompts of different lengths)."""
    import mudpuppy.backends.torch.generation.sampling as sampling

    prompts = [[5, 6, 7]] * 3 + [[8, 9, 10, 11, 12]] * 3 + [[13, 14]]
    seeds = [1, 1, 1, 2, 2, 2, 3]
    widths = []
    hook = handle.model.register_forward_pre_hook(
        lambda _m, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        shared = [backend.sample(handle, prompts, 8, [], Sampling(temperature=1.3), seed=s) for s in (seeds, 4)]
        first_forward = widths[0]
        monkeypatch.setattr(sampling, "shared_prefill", lambda *a: None)
        widths.clear()
        alone = [backend.sample(handle, prompts, 8, [], Sampling(temperature=1.3), seed=s) for s in (seeds, 4)]
    finally:
        hook.remove()
    assert first_forward == (3, 4)                   # 3 distinct prompts, all but the last of 5 columns
    assert widths[0] == (7, 5)                       # without sharing: every row, every column
    assert shared == alone
    assert len({tuple(r) for r in shared[0][:3]}) > 1   # the group's rows still draw apart


def test_decoding_on_a_cpu_packs_grouped_query_heads_instead_of_sdpa_enable_gqa(backend, handle, monkeypatch):
    """One-query attention of a grouped-query model (the tiny model: 4 query heads, 2 key/value heads)
    goes through transformers' packing, not SDPA's enable_gqa (5x slower in bf16 on a CPU at one query);
    the tokens are those of the unpatched attention, and the attention table is left as it was."""
    import contextlib

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import mudpuppy.backends.torch.generation.sampling as sampling

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.shape[1], q.shape[2], k.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, *args, **kwargs)

    prompts = [[5, 6, 7, 8]] * 2 + [[9, 10, 11, 12]]           # one length: no mask, where enable_gqa was taken
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    packed = backend.sample(handle, prompts, 6, [], Sampling(top_k=1), seed=3)
    greedy = backend.generate(handle, prompts, 6, [])
    decode = [c for c in calls if c[0] * c[1] == 4 and c[2] == 2]      # 4 query heads x 1 position
    assert decode and all(c == (2, 2, 2, False) for c in decode)     # [rows, kv heads, group, dim]
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    from mudpuppy.backends.torch.generation.decode_attention import packed_kv_heads_at_decode

    cpu = torch.device("cpu")
    with packed_kv_heads_at_decode(cpu):                    # nested holders (tests/backends/test_process_scope.py: threads)
        with packed_kv_heads_at_decode(cpu):
            pass
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward     # still held by the outer one
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    monkeypatch.setattr(sampling, "packed_kv_heads_at_decode", lambda device: contextlib.nullcontext())
    calls.clear()
    assert backend.sample(handle, prompts, 6, [], Sampling(top_k=1), seed=3) == packed
    assert backend.generate(handle, prompts, 6, []) == greedy
    assert any(c[3] for c in calls)                                  # without it: enable_gqa


def test_grpo_micro_batches_get_the_attention_kernel_for_their_shape(backend, handle, monkeypatch):
    import mudpuppy.backends.torch.forward as torch_forward
    from mudpuppy.training.grpo_loss import RolloutBatch

    shapes = []
    monkeypatch.setattr(torch_forward, "attention_kernels", lambda device, rows, width, heads: shapes.append(
        (rows, width)) or __import__("contextlib").nullcontext())
    batch = completion_batch([[5, 6, 7]] * 2, [[8, 9], [10]], [True, True], 0)
    micro = RolloutBatch(batch, np.zeros(2, np.float32), np.nonzero(batch.labels != -100)[0], None, None)
    with backend.step_kernels(handle, micro):
        pass
    assert shapes == [(2, 5)]


def test_top_k_1_is_greedy_and_rows_end_at_their_stop_token(backend, handle):
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    greedy = backend.generate(handle, prompts, 10, [])
    stop = greedy[0][3]                      # a token greedy decoding emits: row 0 must end right after it
    sampled = backend.sample(handle, prompts, 10, [stop], Sampling(temperature=0.7, top_k=1), seed=1)
    assert sampled[0] == greedy[0][:4]
    for row, full in zip(sampled, greedy):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert row == full[:cut]
        assert stop not in row[:-1]


def test_the_trained_ids_are_the_sampled_ids(backend, handle, tiny_config, tmp_path, monkeypatch):
    """Decoding and encoding again would change these ids (a merged token sampled as its single
    bytes); the micro-batch must hold them exactly, and nothing may encode text while rolling out."""
    from mudpuppy.data.examples import Example, PromptExample
    from mudpuppy.rewards import load_reward_functions, parse_reward_specs

    tok = handle.tokenizer
    merged = next(t for t, i in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
                  if len(t) > 2 and t.isalpha() and tok(t, add_special_tokens=False)["input_ids"] == [i])
    split = [tok.convert_tokens_to_ids(c) for c in merged]
    assert tok(tok.decode(split), add_special_tokens=False)["input_ids"] != split    # a round trip would change them
    sampled = [split, split[::-1], split + split, split[:2]]
    monkeypatch.setattr(backend, "sample", lambda *a, **k: [list(r) for r in sampled])
    cfg = load_config(grpo_config(tiny_config, tmp_path / "run"))
    prompt = PromptExample(Example(np.array([3, 4, 5]), np.zeros(3, bool)), {"prompt": "hi", "answer": "4"})
    funcs = load_reward_functions(parse_reward_specs(cfg.grpo.reward_funcs, None), None)
    rollouts = RolloutBatcher(cfg, backend, handle, [prompt], funcs, out=tmp_path)

    def no_encoding(*args, **kwargs):
        raise AssertionError("a completion was tokenized again")

    monkeypatch.setattr(type(tok), "__call__", no_encoding)
    monkeypatch.setattr(type(tok), "encode", no_encoding)
    micro = rollouts.next_batch()
    trained = [row[row != -100].tolist() for row in micro.batch.labels]
    assert sorted(map(tuple, trained)) == sorted(map(tuple, sampled))


def test_completion_batch_aligns_targets_after_the_prompt():
    batch = completion_batch([[1, 2, 3], [4]], [[7, 8], [9, 10, 11]], [True, False], pad_id=0)
    np.testing.assert_array_equal(batch.input_ids, [[1, 2, 3, 7, 8], [4, 9, 10, 11, 0]])
    np.testing.assert_array_equal(batch.labels, [[-100, -100, 7, 8, -100], [-100] * 5])
    np.testing.assert_array_equal(batch.attention_mask, [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])


# --------------------------------------------------------------------------- token log-probs

def test_token_logprobs_match_the_full_logits_and_chunking_keeps_the_gradient(backend, handle, monkeypatch):
    from mudpuppy.backends.torch import logprobs

    batch = completion_batch([[3, 4, 5], [6, 7, 8]], [[9, 10, 11, 12], [13, 14]], [True, True], pad_id=0)
    logits = backend.logits(handle, batch)
    keep = batch.labels != -100
    logp = torch.log_softmax(torch.as_tensor(logits[keep]) / 0.7, -1)
    oracle = logp.gather(1, torch.as_tensor(batch.labels[keep])[:, None])[:, 0]
    oracle_entropy = -(logp.exp() * logp).sum(-1)
    ours, entropy = backend.token_logprobs(handle, batch, grad=False, temperature=0.7, entropy=True)
    torch.testing.assert_close(ours, oracle, atol=1e-5, rtol=0)
    np.testing.assert_allclose(entropy, oracle_entropy.numpy(), atol=1e-5)

    # With gradient, a chunk at a time (checkpointed) or all at once: the same gradient.
    weight = handle.model.get_output_embeddings().weight
    weight.requires_grad_(True)
    try:
        grads = []
        for chunk in (3, 1024):
            monkeypatch.setattr(logprobs, "LOSS_CHUNK_TOKENS", chunk)
            values, _ = backend.token_logprobs(handle, batch, grad=True)
            weight.grad = None
            values.sum().backward()
            grads.append(weight.grad.clone())
        torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)   # summation order only
        assert grads[0].abs().max() > 0
    finally:
        weight.requires_grad_(False)
        weight.grad = None


# --------------------------------------------------------------------------- runs

def test_a_grpo_run_logs_trl_metrics_and_completions(tiny_config, tmp_path):
    cfg = grpo_config(tiny_config, tmp_path / "run", beta=0.04, num_iterations=2)
    result = run(load_config(cfg), echo=lambda *_: None)
    out = result.output_dir
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    made = [r for r in rows if "reward" in r]
    assert [r["step"] for r in made] == [1, 3]        # num_iterations 2: each generation serves two steps
    for key in ("reward", "reward_std", "frac_reward_zero_std", "rewards/length/mean", "rewards/exact_match/mean",
                "completions/mean_length", "completions/clipped_ratio", "time/generation", "time/training"):
        assert key in made[0], key
    for key in ("kl", "entropy", "clip_ratio/region_mean"):
        assert all(key in r for r in rows), key
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)     # the adapter starts as the reference
    assert rows[1]["kl"] > 0                                  # and moved after one update
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 4                              # two generations of one prompt x 4
    assert set(samples[0]) == {"step", "prompt", "completion", "rewards", "advantage"}
    assert (out / "adapter_model.safetensors").exists()
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["method"] == "grpo" and summary["first_reward"] == made[0]["reward"]


def test_bad_reward_function_stops_before_any_model_loads(tiny_config, tmp_path):
    (tmp_path / "rewards.py").write_text("def good(prompts, completions, **kw):\n    return [1.0] * len(prompts)\n")
    cfg = grpo_config(tiny_config, tmp_path / "run")
    cfg["grpo"]["reward_funcs"] = [str(tmp_path / "rewards.py") + ":missing"]
    cfg["model"] = {"base_model": str(tmp_path / "no-such-model")}
    with pytest.raises(MudpuppyError, match="missing") as err:
        run(load_config(cfg), echo=lambda *_: None)
    assert "good" in str(err.value)                # what the file does define
    assert not (tmp_path / "run").exists()


def test_grpo_config_is_checked_up_front(tiny_config, tmp_path):
    cfg = grpo_config(tiny_config, tmp_path / "run", num_generations=3)
    with pytest.raises(ConfigError, match="whole number of groups"):
        load_config(cfg)
    cfg = grpo_config(tiny_config, tmp_path / "run", beta=0.1)
    cfg["adapter"] = {"type": "none"}
    with pytest.raises(ConfigError, match="grpo.beta"):
        load_config(cfg)


def test_sigkill_then_resume_gives_the_same_rewards_and_losses(tiny_config, tmp_path):
    """steps_per_generation 2 with accumulation 1: the kill lands inside a generation, so the
    resumed run must continue from the saved rollouts, not sample new ones."""
    assert_resume_is_exact(tmp_path, lambda out: grpo_config(tiny_config, out, steps_per_generation=2, beta=0.04))


def assert_resume_is_exact(tmp_path, make_config) -> None:
    """A run SIGKILLed after step 3 and resumed equals one that ran straight: losses, rewards, weights
    and completions. `make_config(output_dir)` gives the online run's config dict."""
    runs = {}
    for name in ("straight", "broken"):
        cfg = make_config(tmp_path / name)
        cfg["training"].update(max_steps=6, save_steps=1)
        cfg["adapter"]["dropout"] = 0.1          # dropout draws from the RNG the checkpoint restores
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        runs[name] = path
    assert cli(runs["straight"]).returncode == 0
    killed = cli(runs["broken"], env=kill_after(3))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = cli(runs["broken"], "--resume")
    assert resumed.returncode == 0, resumed.stderr

    def rows(name):
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    a, b = rows("straight"), rows("broken")
    assert [r["step"] for r in b] == list(range(1, 7))
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], atol=1e-6, rtol=0)
    assert [r.get("reward") for r in b] == [r.get("reward") for r in a]
    wa = load_file(str(tmp_path / "straight" / "adapter_model.safetensors"))
    wb = load_file(str(tmp_path / "broken" / "adapter_model.safetensors"))
    for key in wa:
        np.testing.assert_allclose(wa[key], wb[key], atol=1e-6, rtol=0)
    samples = lambda name: (tmp_path / name / "completions.jsonl").read_text()   # noqa: E731
    assert samples("broken") == samples("straight")
