"""In bf16, an online method's stored reference (and GRPO's old policy) is the policy's own numbers while
they are the same weights: the pass without gradient runs the attention kernel a training step on that
micro-batch runs (issue 40: online DPO's step-1 loss was 0.6919 in bf16, not ln 2)."""

from __future__ import annotations

import numpy as np
import torch

from mudpuppy import create_backend, load_config
from mudpuppy.training.rollout import completion_batch


def test_reference_and_policy_passes_agree_bitwise_in_bf16_at_the_start(tiny_config):
    backend = create_backend("cpu", precision="bf16")
    cfg = load_config(tiny_config)
    handle = backend.load_model(cfg.model, "bf16")
    backend.attach_adapter(handle, cfg.adapter.model_copy(update={"type": "lora", "dropout": 0.0}))
    assert handle.autocast_dtype == torch.bfloat16
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 100, n).tolist() for n in (7, 12, 5, 9)]
    completions = [rng.integers(3, 100, n).tolist() for n in (20, 6, 31, 14)]
    batch = completion_batch(prompts, completions, [True] * 4, pad_id=0)
    # What the rollout stores, outside any training step: the reference (adapter off) and the old policy.
    reference, _ = backend.token_logprobs(handle, batch, grad=False, reference=True)
    old, _ = backend.token_logprobs(handle, batch, grad=False)
    # What the objective computes inside the trainer's step, the adapter (B = 0) on.
    handle.model.train()
    with backend.step_kernels(handle, batch):
        policy, _ = backend.token_logprobs(handle, batch, grad=True)
    assert torch.equal(policy.detach(), old)
    assert torch.equal(policy.detach(), reference)
