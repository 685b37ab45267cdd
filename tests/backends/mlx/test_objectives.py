"""The protocol's objective path on MLX: ArrayOps, sequence log-probs, the adapter-off reference,
and a DPO-style step, each against the torch backend (tiny model, fp32)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core")

from mudpuppy import load_config
from mudpuppy.data import Batch
from mudpuppy.errors import MudpuppyError

from .conftest import make_peft_adapter, model_cfg, random_batch

pytestmark = pytest.mark.mlx


class PairLoss:
    """Sigmoid DPO over rows (chosen, rejected, chosen, rejected, ...), written only with `backend.ops`."""

    def __init__(self, backend, beta: float = 0.5):
        self.backend, self.ops, self.beta = backend, backend.ops, beta

    def count(self, batch) -> int:
        return batch.input_ids.shape[0] // 2

    def __call__(self, handle, batch):
        ops = self.ops
        logps, _ = self.backend.sequence_logprobs(handle, batch)
        ref = self.backend.reference_logprobs(handle, batch)
        pairs = np.arange(self.count(batch))
        ratio_c = ops.take(logps, 2 * pairs) - ops.take(ref, 2 * pairs)
        ratio_r = ops.take(logps, 2 * pairs + 1) - ops.take(ref, 2 * pairs + 1)
        losses = -ops.log_sigmoid(self.beta * (ratio_c - ratio_r))
        return ops.sum(losses), {"margin": float(ops.to_numpy(ratio_c - ratio_r).mean())}


def test_sequence_and_reference_logprobs_match_torch(tiny_model_dir, torch_backend, mlx_backend, tmp_path):
    make_peft_adapter(tiny_model_dir, tmp_path / "peft", dora=True)
    th = torch_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    torch_backend.load_adapter(th, str(tmp_path / "peft"))
    mh = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    mlx_backend.load_adapter(mh, str(tmp_path / "peft"))
    batch = random_batch(len(th.tokenizer), rows=4)
    t_logps, t_counts = torch_backend.sequence_logprobs(th, batch, grad=False)
    m_logps, m_counts = mlx_backend.sequence_logprobs(mh, batch, grad=False)
    assert np.array_equal(t_counts, m_counts)
    assert np.abs(torch_backend.ops.to_numpy(t_logps) - mlx_backend.ops.to_numpy(m_logps)).max() < 1e-4
    t_ref = torch_backend.ops.to_numpy(torch_backend.reference_logprobs(th, batch))
    m_ref = mlx_backend.ops.to_numpy(mlx_backend.reference_logprobs(mh, batch))
    assert np.abs(t_ref - m_ref).max() < 1e-4
    assert np.abs(m_ref - mlx_backend.ops.to_numpy(m_logps)).max() > 1e-2  # the adapter really was off
    base = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    plain, _ = mlx_backend.sequence_logprobs(base, batch)
    assert np.abs(mlx_backend.ops.to_numpy(plain) - m_ref).max() < 1e-5


def test_a_dpo_style_objective_trains_the_same_on_both(tiny_config, torch_backend, mlx_backend, tmp_path):
    tiny_config["training"].update(optimizer="adamw", learning_rate=2e-2, max_steps=5)
    cfg = load_config(tiny_config)
    torch_backend.seed(cfg.training.seed)
    th = torch_backend.load_model(cfg.model, "fp32")
    torch_backend.attach_adapter(th, cfg.adapter)
    torch_backend.save_adapter(th, str(tmp_path / "init"))
    mh = mlx_backend.load_model(cfg.model, "fp32")
    mlx_backend.load_adapter(mh, str(tmp_path / "init"), trainable=True)
    t_trainer, m_trainer = torch_backend.create_trainer(th, cfg.training), mlx_backend.create_trainer(mh, cfg.training)
    t_loss, m_loss = PairLoss(torch_backend), PairLoss(mlx_backend)
    micro = [random_batch(len(th.tokenizer), rows=4, seed=k) for k in range(2)]
    for _ in range(5):
        t, m = t_trainer.step(micro, 2e-2, t_loss), m_trainer.step(micro, 2e-2, m_loss)
        assert t.loss_tokens == m.loss_tokens == 4
        assert abs(t.loss - m.loss) < 1e-3 and abs(t.metrics["margin"] - m.metrics["margin"]) < 1e-3
    assert m.metrics["margin"] > 0.1  # trained on the same pairs, the chosen rows pull ahead


def test_left_padding_gets_an_exact_mask(tiny_model_dir, torch_backend, mlx_backend):
    th = torch_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    mh = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    right = random_batch(len(th.tokenizer), rows=3)
    ids, attn, labels = right.input_ids.copy(), right.attention_mask.copy(), right.labels.copy()
    for r in range(ids.shape[0]):  # move each row's padding to the front
        n = int(attn[r].sum())
        shift = ids.shape[1] - n
        ids[r], attn[r], labels[r] = np.roll(ids[r], shift), np.roll(attn[r], shift), np.roll(labels[r], shift)
    left = Batch(ids, labels, attn)
    real = attn.astype(bool)
    t, m = torch_backend.logits(th, left), mlx_backend.logits(mh, left)
    assert np.abs(t[real] - m[real]).max() < 1e-4 and np.isfinite(m).all()
    assert mlx_backend.evaluate_loss(mh, [left])[0] == pytest.approx(torch_backend.evaluate_loss(th, [left])[0], rel=1e-5)


def test_an_unknown_head_is_refused_by_name(tiny_model_dir, mlx_backend):
    with pytest.raises(MudpuppyError, match="unknown model head 'regression'"):
        mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32", head="regression")


def test_scores_need_the_matching_head(tiny_model_dir, mlx_backend):
    handle = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    with pytest.raises(MudpuppyError, match="scores need load_model"):
        mlx_backend.sequence_scores(handle, None)
