"""Distillation's divergences against TRL 1.16's own functions, and the torch backend's chunked
token_divergence against the two models' full forwards.

Oracles (TRL imported, not copied):
- `trl.trainer.distillation_trainer._chunked_divergence_loss`: DistillationTrainer's loss from hidden states
  and heads (forward KL at beta 0, reverse KL at 1, generalized JSD between), value and gradient;
- `trl.experimental.gkd.GKDTrainer.generalized_jsd_loss`: GKD's loss from [B, T, V] logits with labels;
- `trl.experimental.server_distillation`'s `_add_tail_bucket` and `_jsd_divergence`: the top-k teacher
  tokens with the tail bucket.

Tolerance: 1e-5 absolute, fp32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mudpuppy import create_backend, load_config
from mudpuppy.backends.torch.divergence import top_k_buckets
from mudpuppy.data import Batch
from mudpuppy.errors import MudpuppyError
from mudpuppy.training.distill import DistillObjective, check_vocabularies
from mudpuppy.training.distill_loss import divergence_terms

from ..conftest import build_tiny_model, randomize_lora, tiny_run_config

pytest.importorskip("trl")
from trl.experimental.gkd.gkd_trainer import GKDTrainer  # noqa: E402
from trl.experimental.server_distillation.server_distillation_trainer import (  # noqa: E402
    _add_tail_bucket, _jsd_divergence)
from trl.trainer.distillation_trainer import _chunked_divergence_loss  # noqa: E402

TOL = 1e-5
BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


@pytest.fixture(scope="module")
def backend():
    return create_backend("cpu")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A second tiny Llama, wider and differently initialised, with the same tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-teacher"), seed=7, hidden_size=48)


def heads(n=37, vocab=53, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 16, generator=g), torch.randn(vocab, 16, generator=g) * 0.5,
            torch.randn(n, 24, generator=g), torch.randn(vocab, 24, generator=g) * 0.5)


def ours(ops, s_logits, t_logits, beta, temperature):
    return divergence_terms(ops, (s_logits / temperature).log_softmax(-1), (t_logits / temperature).log_softmax(-1),
                            beta).sum()


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_divergence_and_its_gradient_equal_the_distillation_trainers(backend, beta, temperature):
    hs, ws, ht, wt = heads()
    hs_trl, hs_ours = hs.clone().requires_grad_(), hs.clone().requires_grad_()
    trl, _, n = _chunked_divergence_loss(hs_trl[None], ht[None], ws, wt, torch.ones(1, len(hs)), beta,
                                         temperature=temperature)
    mine = ours(backend.ops, hs_ours @ ws.T, ht @ wt.T, beta, temperature) / len(hs)
    assert abs(float(mine.detach()) - float(trl.detach())) < TOL
    trl.backward()
    mine.backward()
    assert torch.allclose(hs_ours.grad, hs_trl.grad, atol=TOL)


@pytest.mark.parametrize("beta", BETAS)
def test_divergence_equals_gkds_generalized_jsd_loss_with_labels(backend, beta):
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(3, 9, 41, generator=g) * 2, torch.randn(3, 9, 41, generator=g) * 2
    labels = torch.randint(0, 41, (3, 9), generator=g)
    labels[0, :4] = labels[2, 6:] = -100
    trl = GKDTrainer.generalized_jsd_loss(s, t, labels=labels, beta=beta, temperature=0.9)
    keep = labels != -100
    mine = ours(backend.ops, s[keep], t[keep], beta, 0.9) / keep.sum()
    assert abs(float(mine) - float(trl)) < TOL


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("k", [1, 5])
def test_top_k_buckets_equal_the_server_distillations_tail_bucket(backend, beta, k):
    hs, ws, ht, wt = heads(seed=2)
    s, t = (hs @ ws.T).log_softmax(-1), (ht @ wt.T).log_softmax(-1)
    index = t.topk(k, dim=-1).indices
    valid = torch.ones_like(index, dtype=torch.bool)
    s_k, mask = _add_tail_bucket(s.gather(-1, index), valid)
    t_k, _ = _add_tail_bucket(t.gather(-1, index), valid)
    trl = _jsd_divergence(s_k, t_k, beta, support_mask=mask).sum()
    mine = divergence_terms(backend.ops, *top_k_buckets(s, t, k), beta).sum()
    assert abs(float(mine) - float(trl)) < TOL


# --------------------------------------------------------------------------- the backend's chunked path

def batch_of(rows, pad=0):
    """Right-padded rows of (ids, first loss position)."""
    width = max(len(ids) for ids, _ in rows)
    ids = np.full((len(rows), width), pad, np.int64)
    labels = np.full_like(ids, -100)
    attn = np.zeros_like(ids)
    for r, (seq, first) in enumerate(rows):
        ids[r, : len(seq)] = seq
        attn[r, : len(seq)] = 1
        labels[r, first : len(seq) - 1] = seq[first + 1 :]
    return Batch(ids, labels, attn)


def models(backend, tiny_model_dir, teacher_dir, tmp_path):
    cfg = load_config(distill_raw(tiny_model_dir, teacher_dir, tmp_path))
    student = backend.load_model(cfg.model, "fp32")
    backend.attach_adapter(student, cfg.adapter)
    randomize_lora(student.model, seed=3, scale=0.3)
    teacher = backend.load_model(load_config(tiny_run_config(teacher_dir, tmp_path / "t")).model, "fp32")
    return cfg, student, teacher


def distill_raw(tiny_model_dir, teacher_dir, tmp_path, **distill):
    raw = tiny_run_config(tiny_model_dir, tmp_path / "run")
    raw["method"] = "distill"
    raw["distill"] = {"teacher": str(teacher_dir), **distill}
    return raw


RNG = np.random.default_rng(0)
ROWS = [(RNG.integers(3, 300, n).tolist(), first) for n, first in [(23, 5), (11, 2), (30, 20), (7, 6)]]


@pytest.mark.parametrize("loss,top_k", [("jsd", 0), ("forward_kl", 0), ("reverse_kl", 4)])
def test_token_divergence_equals_the_loss_of_both_models_full_logits(backend, tiny_model_dir, teacher_dir, tmp_path,
                                                                     monkeypatch, loss, top_k):
    """The chunked path (chunks of 16 rows here) against TRL's loss on each model's own [B, T, V] logits;
    with gradient the same value."""
    monkeypatch.setattr("mudpuppy.backends.torch.divergence.CHUNK_TOKENS", 16)
    cfg, student, teacher = models(backend, tiny_model_dir, teacher_dir, tmp_path)
    d = cfg.distill.model_copy(update={"loss": loss, "top_k": top_k, "beta": 0.3})
    batch = batch_of(ROWS)
    s_logits = torch.as_tensor(backend.logits(student, batch))
    t_logits = torch.as_tensor(backend.logits(teacher, batch))
    keep = torch.as_tensor(batch.labels != -100)
    if top_k:
        s, t = top_k_buckets((s_logits[keep] / d.temperature).log_softmax(-1),
                             (t_logits[keep] / d.temperature).log_softmax(-1), top_k)
        expected = float(_jsd_divergence(s, t, d.trl_beta, torch.ones_like(s, dtype=torch.bool)).sum())
    else:
        expected = float(GKDTrainer.generalized_jsd_loss(s_logits, t_logits, torch.as_tensor(batch.labels),
                                                         beta=d.trl_beta, temperature=d.temperature)) * int(keep.sum())
    objective = DistillObjective(backend, teacher, d)
    assert objective.count(batch) == int(keep.sum())
    without, _ = objective(student, batch, grad=False)
    with_grad, _ = objective(student, batch, grad=True)
    assert abs(float(without) - expected) < TOL * max(1.0, abs(expected))
    assert abs(float(with_grad) - expected) < TOL * max(1.0, abs(expected))
    with_grad.backward()
    lora = [p.grad for n, p in student.model.named_parameters() if "lora_" in n]
    assert all(g is not None for g in lora) and any(float(g.abs().sum()) > 0 for g in lora)


def test_the_teachers_chunks_are_its_own_forward(backend, tiny_model_dir, teacher_dir, tmp_path, monkeypatch):
    """What the divergence receives as the teacher's log-probs, chunk by chunk, is log_softmax of the
    teacher's own forward at the loss positions, in order."""
    monkeypatch.setattr("mudpuppy.backends.torch.divergence.CHUNK_TOKENS", 16)
    _, student, teacher = models(backend, tiny_model_dir, teacher_dir, tmp_path)
    batch = batch_of(ROWS)
    seen = []

    def record(s, t):
        seen.append(t.detach().numpy().copy())
        return s * 0

    backend.token_divergence(student, teacher, batch, record, grad=False, temperature=0.5)
    keep = batch.labels != -100
    full = torch.as_tensor(backend.logits(teacher, batch)[keep] / 0.5).log_softmax(-1).numpy()
    assert len(seen) == -(-int(keep.sum()) // 16)
    np.testing.assert_allclose(np.concatenate(seen), full, atol=TOL)


def test_a_teacher_of_another_vocabulary_is_refused_naming_both(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    other = build_tiny_model(tmp_path / "other", seed=1)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra_token>"])
    tok.save_pretrained(other)
    cfg = load_config(distill_raw(tiny_model_dir, other, tmp_path))
    with pytest.raises(MudpuppyError) as err:
        check_vocabularies(cfg)
    text = str(err.value)
    assert str(other) in text and str(tiny_model_dir) in text and f"{len(tok):,} tokens" in text
