"""What GRPO asks of the MLX backend: per-token log-probs at a temperature (chunked head, entropy,
reference, gradient), keyed batched sampling, and the two ArrayOps it adds; each against an oracle
(numpy, the greedy decoder, sequence_logprobs, the torch backend)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core")

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from mudpuppy import load_config
from mudpuppy.backends.mlx import generation, logprobs
from mudpuppy.backends.mlx.layers import adapter_layers
from mudpuppy.backends.mlx.sampling import draw, filter_logits
from mudpuppy.backends.protocol import Sampling

from .conftest import model_cfg, random_batch

pytestmark = pytest.mark.mlx

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20], [11, 12, 13], [40, 41, 42, 43]]


def numpy_logprobs(logits: np.ndarray, labels: np.ndarray, temperature: float):
    """The oracle: float32 logits / temperature -> log-softmax -> the label's entry, and the entropy."""
    keep = labels != -100
    x = logits[keep].astype(np.float64) / temperature           # boolean indexing is row-major
    top = x.max(axis=-1, keepdims=True)
    logp = x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))
    picked = logp[np.arange(len(logp)), labels[keep]]
    return picked, -(np.exp(logp) * logp).sum(axis=-1)


def lora_handle(backend, tiny_config, dropout: float = 0.0):
    """The tiny model under a LoRA adapter whose B is random, so the adapter changes every output."""
    tiny_config["adapter"]["dropout"] = dropout
    cfg = load_config(tiny_config)
    handle = backend.load_model(cfg.model, "fp32")
    backend.attach_adapter(handle, cfg.adapter)
    key = mx.random.key(7)
    for layer in adapter_layers(handle.model).values():
        key, sub = mx.random.split(key)
        layer.lora_b = 0.3 * mx.random.normal(layer.lora_b.shape, key=sub)
    mx.eval(handle.model.parameters())
    return handle


def gradients(model, fn) -> dict[str, np.ndarray]:
    _, grads = nn.value_and_grad(model, fn)()
    return {k: np.array(v) for k, v in tree_flatten(grads)}


# ------------------------------------------------------------------ token_logprobs
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_a_numpy_oracle(tiny_model_dir, mlx_backend, temperature):
    handle = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    batch = random_batch(len(handle.tokenizer), rows=3)
    logps, entropy = mlx_backend.token_logprobs(handle, batch, grad=False, temperature=temperature, entropy=True)
    want, want_entropy = numpy_logprobs(mlx_backend.logits(handle, batch), batch.labels, temperature)
    assert logps.dtype == mx.float32 and logps.shape == (batch.loss_tokens,)
    assert np.abs(np.array(logps) - want).max() < 1e-5
    assert isinstance(entropy, np.ndarray) and np.abs(entropy - want_entropy).max() < 1e-5
    assert mlx_backend.token_logprobs(handle, batch, temperature=temperature)[1] is None


@pytest.mark.parametrize("split_head", [True, False], ids=["head-on-positions", "full-logits"])
def test_many_small_chunks_give_the_same_values(tiny_model_dir, mlx_backend, monkeypatch, split_head):
    handle = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    batch = random_batch(len(handle.tokenizer), rows=4, width=16)
    want, want_entropy = numpy_logprobs(mlx_backend.logits(handle, batch), batch.labels, 0.7)
    monkeypatch.setattr(logprobs, "CHUNK_ROWS", 5)
    handle.split_head = split_head
    assert batch.loss_tokens > 3 * logprobs.CHUNK_ROWS
    logps, entropy = mlx_backend.token_logprobs(handle, batch, grad=False, temperature=0.7, entropy=True)
    assert np.abs(np.array(logps) - want).max() < 1e-5 and np.abs(entropy - want_entropy).max() < 1e-5


def test_reference_switches_the_adapter_off(tiny_model_dir, tiny_config, mlx_backend):
    handle = lora_handle(mlx_backend, tiny_config)
    handle.model.train()
    batch = random_batch(len(handle.tokenizer), rows=3)
    ref, ref_entropy = mlx_backend.token_logprobs(handle, batch, temperature=0.7, reference=True, entropy=True)
    base = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    plain, plain_entropy = mlx_backend.token_logprobs(base, batch, grad=False, temperature=0.7, entropy=True)
    assert np.abs(np.array(ref) - np.array(plain)).max() < 1e-5
    assert np.abs(ref_entropy - plain_entropy).max() < 1e-5
    policy, _ = mlx_backend.token_logprobs(handle, batch, temperature=0.7)
    assert np.abs(np.array(policy) - np.array(ref)).max() > 1e-2       # the adapter really was on, then off
    assert handle.model.training and all(layer.enabled for layer in adapter_layers(handle.model).values())
    # No gradient reaches the adapter through the reference, nor without grad.
    for kwargs in ({"reference": True}, {"grad": False}):
        grads = gradients(handle.model, lambda kw=kwargs: mlx_backend.token_logprobs(handle, batch, **kw)[0].sum())
        assert all(not g.any() for g in grads.values())


def adapted_handle(backend, tiny_config, adapter: str):
    """lora_handle's model, or (adapter none) the tiny model trained in full."""
    if adapter == "lora":
        return lora_handle(backend, tiny_config)
    tiny_config["adapter"] = {"type": "none"}
    cfg = load_config(tiny_config)
    handle = backend.load_model(cfg.model, "fp32")
    backend.attach_adapter(handle, cfg.adapter)
    return handle


@pytest.mark.parametrize("adapter", ["lora", "none"], ids=["lora", "full"])
def test_the_gradient_is_sequence_logprobs_gradient(tiny_config, mlx_backend, monkeypatch, adapter):
    """Summed over a batch, both are the same log-probs at temperature 1: so are their gradients, through
    several checkpointed chunks, to the adapter or (full fine-tune) to every weight, tied head included."""
    handle = adapted_handle(mlx_backend, tiny_config, adapter)
    handle.model.train()
    batch = random_batch(len(handle.tokenizer), rows=4, width=14)
    monkeypatch.setattr(logprobs, "CHUNK_ROWS", 4)
    by_token = gradients(handle.model, lambda: mlx_backend.token_logprobs(handle, batch, entropy=True)[0].sum())
    by_row = gradients(handle.model, lambda: mlx_backend.sequence_logprobs(handle, batch)[0].sum())
    assert by_token.keys() == by_row.keys()
    if adapter == "none":
        assert "model.embed_tokens.weight" in by_token   # the tied head is trained through the checkpoint
    for name, grad in by_token.items():
        assert np.abs(grad).max() > 0, name
        np.testing.assert_allclose(grad, by_row[name], rtol=1e-4, atol=1e-5 * np.abs(grad).max(), err_msg=name)


@pytest.mark.parametrize("adapter", ["lora", "none"], ids=["lora", "full"])
def test_the_chunked_backward_is_mlx_autodiff_at_any_temperature(tiny_config, mlx_backend, monkeypatch, adapter):
    """The head's hand-written VJP against MLX differentiating the full-logits path, with a temperature
    and a different weight on every token (each chunk gets its own slice of the cotangent)."""
    handle = adapted_handle(mlx_backend, tiny_config, adapter)
    batch = random_batch(len(handle.tokenizer), rows=4, width=14)
    weights = mx.array(np.random.default_rng(1).normal(size=batch.loss_tokens).astype(np.float32))
    monkeypatch.setattr(logprobs, "CHUNK_ROWS", 6)

    def weighted():
        return (mlx_backend.token_logprobs(handle, batch, temperature=0.6)[0] * weights).sum()

    chunked = gradients(handle.model, weighted)
    handle.split_head = False            # full logits, differentiated by MLX
    autodiff = gradients(handle.model, weighted)
    for name, grad in chunked.items():
        assert np.abs(grad).max() > 0, name
        np.testing.assert_allclose(grad, autodiff[name], rtol=1e-4, atol=1e-5 * np.abs(grad).max(), err_msg=name)


def test_the_head_s_memory_does_not_grow_with_the_positions(monkeypatch):
    """With or without gradient, peak memory is set by the chunk, not by N: four times the positions
    cost about the same, a fraction of their [N, vocab] float32 logits (a lazy chunked head holds
    them all, several times over with gradient)."""
    width, vocab = 16, 4000
    head = nn.Linear(width, vocab, bias=False)
    mx.eval(head.parameters())
    monkeypatch.setattr(logprobs, "CHUNK_ROWS", 64)

    def peak(fn) -> int:
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        mx.eval(fn())
        return mx.get_peak_memory() - before

    def peaks(n: int) -> tuple[int, int]:
        rows = mx.random.normal((n, width), key=mx.random.key(0))
        targets = np.random.default_rng(0).integers(0, vocab, n)
        mx.eval(rows)
        grad = mx.grad(lambda r: logprobs.chunked_head(head, head, r, targets, 0.8, False)[0].sum())
        return (peak(lambda: logprobs.chunked_head(head, head, rows, targets, 0.8, True)[0]),
                peak(lambda: grad(rows)))

    small, large = peaks(1024), peaks(4096)
    all_logits = 4096 * vocab * 4
    for few, many in zip(small, large):
        assert many < 1.5 * few and many < all_logits / 3, (small, large, all_logits)


def test_token_logprobs_match_torch(tiny_model_dir, torch_backend, mlx_backend):
    if not hasattr(torch_backend, "token_logprobs"):
        pytest.skip("the torch backend has no token_logprobs yet")
    th = torch_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    mh = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    batch = random_batch(len(th.tokenizer), rows=4)
    for temperature in (1.0, 0.7):
        t_logps, t_entropy = torch_backend.token_logprobs(th, batch, grad=False, temperature=temperature,
                                                          entropy=True)
        m_logps, m_entropy = mlx_backend.token_logprobs(mh, batch, grad=False, temperature=temperature,
                                                        entropy=True)
        assert np.abs(torch_backend.ops.to_numpy(t_logps) - np.array(m_logps)).max() < 1e-4
        assert np.abs(t_entropy - m_entropy).max() < 1e-4


# ------------------------------------------------------------------ ArrayOps
def test_row_sum_and_minimum(mlx_backend):
    ops = mlx_backend.ops
    x = ops.from_numpy(np.array([1.0, 2.0, 3.0, 4.0, 5.0]))
    rows = np.array([0, 2, 0, 2, 2])
    assert np.array(ops.row_sum(x, rows, 4)).tolist() == [4.0, 0.0, 11.0, 0.0]
    assert ops.row_sum(x, rows, 4).dtype == mx.float32
    weights = mx.array([1.0, -1.0, 2.0, 0.5])
    grad = mx.grad(lambda v: (ops.row_sum(v, rows, 4) * weights).sum())(x)
    assert np.array(grad).tolist() == [1.0, 2.0, 1.0, 2.0, 2.0]     # each x[i] gets its row's weight
    assert np.array(ops.row_sum(ops.from_numpy(np.zeros(0)), np.zeros(0, int), 2)).tolist() == [0.0, 0.0]
    a, b = ops.from_numpy(np.array([1.0, -2.0, 3.0])), ops.from_numpy(np.array([0.5, 0.0, 3.5]))
    assert np.array(ops.minimum(a, b)).tolist() == [0.5, -2.0, 3.0]


# ------------------------------------------------------------------ the sampler
def numpy_survivors(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """transformers' warpers re-implemented in numpy: which tokens may still be drawn."""
    x = logits.astype(np.float32) / np.float32(s.temperature)
    if s.top_k:
        x = np.where(x < np.sort(x)[-s.top_k], -np.inf, x)
    if s.top_p < 1.0:
        order = np.argsort(x)
        probs = np.exp(x[order] - x.max())
        cumulative = np.cumsum(probs / probs.sum())
        drop = cumulative <= 1.0 - s.top_p
        drop[-1] = False
        x[order[drop]] = -np.inf
    if s.min_p is not None:
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        x = np.where(probs < s.min_p * probs.max(), -np.inf, x)
    return np.isfinite(x)


@pytest.mark.parametrize("s", [
    Sampling(), Sampling(top_k=5), Sampling(temperature=0.7, top_p=0.9), Sampling(temperature=1.3, top_k=10, top_p=0.5),
    Sampling(min_p=0.1), Sampling(temperature=0.8, top_k=20, top_p=0.8, min_p=0.05), Sampling(top_p=0.01),
    Sampling(top_k=1),
], ids=lambda s: f"t{s.temperature}-k{s.top_k}-p{s.top_p}-m{s.min_p}")
def test_the_filter_chain_keeps_what_transformers_keeps(s):
    logits = np.random.default_rng(0).normal(0.0, 2.0, (3, 50)).astype(np.float32)
    kept = np.isfinite(np.array(filter_logits(mx.array(logits), s)))
    want = np.stack([numpy_survivors(row, s) for row in logits])
    assert np.array_equal(kept, want)
    assert kept.sum(axis=-1).min() >= 1
    # 400 draws of the first row land on its survivors only, and on more than one when several survive.
    drawn = np.array(draw(mx.array(np.repeat(logits[:1], 400, axis=0)), s, mx.random.key(3)))
    assert want[0][drawn].all()
    assert len(set(drawn.tolist())) > 1 or want[0].sum() == 1


# ------------------------------------------------------------------ sample
STOPS = list(range(100, 180))   # a quarter of the vocabulary: rows do stop early


def test_sampling_is_keyed_by_the_seed_alone(tiny_model_dir, mlx_backend):
    handle = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    first = mlx_backend.sample(handle, PROMPTS, 12, STOPS, Sampling(), seed=0)
    assert mlx_backend.sample(handle, PROMPTS, 12, STOPS, Sampling(), seed=0) == first
    assert mlx_backend.sample(handle, PROMPTS, 12, STOPS, Sampling(), seed=1) != first
    assert all(type(t) is int for row in first for t in row)
    for row in first:
        assert 1 <= len(row) <= 12
        assert not any(t in STOPS for t in row[:-1])               # a stop token only ends a row
        assert len(row) == 12 or row[-1] in STOPS
    assert any(len(row) < 12 for row in first)


def test_top_k_1_is_the_greedy_continuation_with_its_stop_token(tiny_model_dir, mlx_backend):
    handle = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    free = mlx_backend.generate(handle, PROMPTS, 10, [])
    stops = [free[0][4], free[2][6]]             # tokens the greedy rows do reach
    greedy = mlx_backend.generate(handle, PROMPTS, 10, stops)
    sampled = mlx_backend.sample(handle, PROMPTS, 10, stops, Sampling(top_k=1, temperature=0.7), seed=5)
    for want, got in zip(greedy, sampled):
        assert got == (want if len(want) == 10 else want + [got[-1]])
        assert len(got) == 10 or got[-1] in stops
    assert any(len(row) < 10 for row in sampled)


def test_prompts_grouped_by_length_sample_the_same_greedy_rows(tiny_model_dir, mlx_backend, monkeypatch):
    """Models whose caches cannot take left padding sample equal-length prompts together."""
    handle = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    padded = mlx_backend.sample(handle, PROMPTS, 8, [], Sampling(top_k=1), seed=0)
    monkeypatch.setattr(generation, "left_paddable", lambda handle: False)
    assert generation.batches(handle, PROMPTS) == [[0], [1, 3], [2], [4]]
    assert mlx_backend.sample(handle, PROMPTS, 8, [], Sampling(top_k=1), seed=0) == padded
    grouped = mlx_backend.sample(handle, PROMPTS, 8, STOPS, Sampling(top_p=0.9), seed=2)
    assert grouped == mlx_backend.sample(handle, PROMPTS, 8, STOPS, Sampling(top_p=0.9), seed=2)


def test_sampling_leaves_the_global_random_state_and_the_mode_alone(tiny_config, mlx_backend):
    """Dropout on in the adapter and the model in train mode: sampling still runs in eval mode (the
    same seed gives the same ids), draws nothing from MLX's global state, and leaves train mode on."""
    handle = lora_handle(mlx_backend, tiny_config, dropout=0.5)
    handle.model.train()
    mx.random.seed(123)
    expected = mx.random.uniform().item()
    mx.random.seed(123)
    first = mlx_backend.sample(handle, PROMPTS, 6, [], Sampling(temperature=0.9, top_k=50), seed=4)
    assert mx.random.uniform().item() == expected
    assert mlx_backend.sample(handle, PROMPTS, 6, [], Sampling(temperature=0.9, top_k=50), seed=4) == first
    assert handle.model.training
    assert all(len(row) == 6 for row in first)
