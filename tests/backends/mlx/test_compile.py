"""`training.compile: true` on MLX: the compiled SFT step computes what the eager one does."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx.utils import tree_flatten

from mudpuppy import load_config
from mudpuppy.backends.mlx.compiled import bucket, padded_arrays, padded_width, position_limit
from mudpuppy.backends.mlx.forward import logprobs_at, target_logprobs, token_targets
from mudpuppy.data import Batch
from mudpuppy.errors import MudpuppyError

from .conftest import model_cfg, random_batch, training_batches

pytestmark = pytest.mark.mlx


def train(backend, cfg, steps, compile_step: bool):
    """Losses, gradient norms and trained weights of a few steps, from the same seed."""
    cfg.training.compile = compile_step
    backend.seed(cfg.training.seed)
    handle = backend.load_model(cfg.model, "fp32", adapter=cfg.adapter)
    backend.attach_adapter(handle, cfg.adapter)
    trainer = backend.create_trainer(handle, cfg.training)
    results = [trainer.step(micro, 1e-2) for micro in steps(handle)]
    weights = dict(tree_flatten(handle.model.trainable_parameters()))
    return [r.loss for r in results], [r.grad_norm for r in results], weights


def assert_same_run(eager, compiled) -> None:
    for ours, theirs in zip(compiled[:2], eager[:2]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    for key, value in eager[2].items():
        np.testing.assert_allclose(np.array(compiled[2][key]), np.array(value), rtol=1e-5, atol=1e-6)


def test_compiled_sft_steps_match_eager(tiny_config, mlx_backend):
    """Real batches of varying widths (padded into buckets), two micro-batches a step, fp32."""
    cfg = load_config(tiny_config)

    def steps(handle):
        return training_batches(cfg, handle.tokenizer, steps=3, accumulation=2)

    eager = train(mlx_backend, cfg, steps, compile_step=False)
    compiled = train(mlx_backend, cfg, steps, compile_step=True)
    widths = {m.input_ids.shape[1] for step in steps(mlx_backend.load_model(cfg.model, "fp32")) for m in step}
    assert any(bucket(w) != w for w in widths)    # padding was exercised
    assert_same_run(eager, compiled)


def test_compiled_dropout_draws_the_eager_masks(tiny_config, mlx_backend):
    """Random state goes in and out of the compiled step: at widths that need no padding the masks,
    and so the losses, are the eager run's, micro-batch after micro-batch and step after step."""
    tiny_config["adapter"]["dropout"] = 0.2
    cfg = load_config(tiny_config)

    def steps(handle):
        vocab = len(handle.tokenizer)
        return [[random_batch(vocab, rows=4, width=12, seed=2 * s + i) for i in range(2)] for s in range(3)]

    eager = train(mlx_backend, cfg, steps, compile_step=False)
    compiled = train(mlx_backend, cfg, steps, compile_step=True)
    assert_same_run(eager, compiled)
    tiny_config["adapter"]["dropout"] = 0.0
    undropped = train(mlx_backend, load_config(tiny_config), steps, compile_step=True)
    assert abs(undropped[0][-1] - compiled[0][-1]) > 1e-4    # dropout was on (B = 0 at first: from step 2)


def test_padding_into_buckets_is_exact(tiny_model_dir, mlx_backend):
    """Left padding (an explicit mask) and target positions, padded: the real targets' log-probs stand."""
    handle = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    batch = random_batch(len(handle.tokenizer), rows=3, width=11)
    shift = batch.attention_mask.sum(axis=1)
    left = Batch(*(np.stack([np.roll(row, batch.input_ids.shape[1] - n) for row, n in zip(a, shift)])
                   for a in (batch.input_ids, batch.labels, batch.attention_mask)))
    for b in (batch, left):
        targets = token_targets(handle, b)
        ids, positions, labels, weights, *mask = padded_arrays(targets, position_limit(handle.config))
        assert ids.shape[1] == 12 and positions.shape[0] == bucket(len(targets.keep)) >= len(targets.keep)
        assert bool(mask) == (b is left)
        padded = logprobs_at(handle, ids, positions, labels, mask[0] if mask else None)
        expected, _ = target_logprobs(handle, b)
        n = len(targets.keep)
        np.testing.assert_allclose(np.array(padded[:n]), np.array(expected), rtol=1e-5, atol=1e-6)
        assert float(weights.sum()) == n


def test_buckets():
    assert [bucket(n) for n in (1, 7, 8, 9, 12, 13, 17, 33, 100, 129)] == [1, 7, 8, 10, 12, 14, 20, 40, 112, 160]
    assert all(n <= bucket(n) < 1.25 * n + 1 for n in range(1, 5000))
    assert padded_width(100, None) == 112 and padded_width(100, 102) == 102 and padded_width(100, 64) == 100
    longrope = {"max_position_embeddings": 4096, "rope_scaling": {"original_max_position_embeddings": 1024}}
    assert position_limit(longrope) == 1024


def test_compile_refuses_objectives_it_cannot_trace(tiny_config, mlx_backend):
    tiny_config["training"]["compile"] = True
    cfg = load_config(tiny_config)
    handle = mlx_backend.load_model(cfg.model, "fp32", adapter=cfg.adapter)
    mlx_backend.attach_adapter(handle, cfg.adapter)
    trainer = mlx_backend.create_trainer(handle, cfg.training)

    class PairObjective:
        def count(self, batch):
            return 1

        def __call__(self, handle, batch):
            return mlx_backend.sequence_logprobs(handle, batch)[0].sum(), {}

    batch = random_batch(len(handle.tokenizer))
    with pytest.raises(MudpuppyError, match=r"training.compile: on the mlx backend .*\(PairObjective\).*"
                                            "set training.compile: false"):
        trainer.step([batch], 1e-3, PairObjective())
