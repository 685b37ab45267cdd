"""The real model: SmolLM2-135M-Instruct answers the same on torch and MLX (slow: loads 135M twice)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core")

from mudpuppy.config import ModelConfig
from mudpuppy.data import Batch, generation_prompt

pytestmark = [pytest.mark.slow, pytest.mark.mlx]

PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_smollm2_greedy_completion_is_the_same_on_both_backends(torch_backend, mlx_backend):
    cfg = ModelConfig(base_model="smollm2-135m-instruct")
    th = torch_backend.load_model(cfg, "fp32")
    mh = mlx_backend.load_model(cfg, "fp32")
    prompt, _ = generation_prompt(th.tokenizer, PROMPT + [{"role": "assistant", "content": ""}])
    assert generation_prompt(mh.tokenizer, PROMPT + [{"role": "assistant", "content": ""}])[0] == prompt
    stop = [th.tokenizer.eos_token_id]
    torch_ids = torch_backend.generate(th, [prompt], 24, stop)[0]
    mlx_ids = mlx_backend.generate(mh, [prompt], 24, stop)[0]
    assert mlx_ids == torch_ids, (th.tokenizer.decode(torch_ids), mh.tokenizer.decode(mlx_ids))
    assert "Paris" in th.tokenizer.decode(torch_ids)
    ids = np.array([prompt])
    batch = Batch(ids, np.full_like(ids, -100), np.ones_like(ids))
    assert np.abs(torch_backend.logits(th, batch) - mlx_backend.logits(mh, batch)).max() < 1e-3
