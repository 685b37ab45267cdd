"""MLX trains on the same loss as torch for families whose forward reworks the head's output (issue 26 part 1).

Tiny models (hidden 64, 2 layers, embeddings scaled by 40 so that soft-capping and
scaling act) saved by transformers and loaded by both backends; MLX runs at a few
GFLOP/s on this CPU, so a handful of short examples.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ...conftest import build_tokenizer
from ..test_model_heads import build, examples
from .conftest import model_cfg

pytest.importorskip("mlx.core")

# Families mlx-lm 0.32 has whose torch forward applies something after the head, and Llama as control.
MLX_FAMILIES = ["llama", "gemma2", "granite", "cohere"]
# mlx-lm's Gemma 2 body itself differs from transformers' (logits up to ~5 apart on this tiny model, with or
# without a sliding window in reach): issue 26 part 5. Its head is still checked against its own forward.
BODY_DIFFERS: set[str] = set()     # Gemma 2's window on MLX: backends/mlx/families.py


@pytest.mark.parametrize("family", MLX_FAMILIES)
def test_mlx_loss_and_logprobs_equal_the_models_own_and_torch(family, tmp_path, mlx_backend, torch_backend):
    import mlx.core as mx

    from mudpuppy.data import collate

    model = build(family)
    model.save_pretrained(tmp_path, safe_serialization=True)
    build_tokenizer(tmp_path)
    # Rows of one length: no padding, whose MLX masks (mlx-lm's Gemma 2 reads them its own way) are not the point.
    batch = collate(examples([9, 9]), pad_id=0)
    m = mlx_backend.load_model(model_cfg(tmp_path), "fp32")
    assert m.split_head, "the chunked head path reproduces the model's own logits"
    m_loss, m_n = mlx_backend.evaluate_loss(m, [batch])
    m_tokens, _ = mlx_backend.token_logprobs(m, batch, grad=False)
    m_tokens = np.array(m_tokens.astype(mx.float32))
    # Against MLX's own full forward: the head path applies what the model applies after its head.
    full = mlx_backend.logits(m, batch)
    keep = batch.labels != -100
    shifted = full - full.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    own = np.take_along_axis(logp[keep], batch.labels[keep][:, None], axis=-1)[:, 0]
    np.testing.assert_allclose(m_tokens, own, atol=1e-4, rtol=1e-5)
    assert m_loss == pytest.approx(float(-own.sum()), rel=1e-5)
    if family in BODY_DIFFERS:
        return
    t = torch_backend.load_model(model_cfg(tmp_path), "fp32")
    with torch.no_grad():
        t_loss, n = torch_backend.loss_sum(t, batch)
        t_tokens, _ = torch_backend.token_logprobs(t, batch, grad=False)
    assert m_n == n
    assert m_loss == pytest.approx(float(t_loss), rel=1e-4)
    np.testing.assert_allclose(m_tokens, t_tokens.numpy(), atol=1e-4, rtol=1e-4)
