"""The torch backend's shortcuts change no number that anything reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mudpuppy import create_backend, load_config
from mudpuppy.backends.torch.backend import _is_right_padded, _store_frozen_linears_in
from mudpuppy.data import Example, collate


def examples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [Example(rng.integers(3, 300, n).astype(np.int32), np.ones(n, dtype=bool)) for n in lengths]


def test_right_padding_detection():
    assert _is_right_padded(np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0]]))
    assert not _is_right_padded(np.array([[0, 1, 1], [1, 1, 1]]))     # left padding keeps its mask
    assert not _is_right_padded(np.array([[1, 0, 1]]))


def test_padded_batch_logits_equal_each_example_alone(tiny_config):
    backend = create_backend("cpu", precision="fp32")
    cfg = load_config(tiny_config)
    handle = backend.load_model(cfg.model, "fp32")
    exs = examples([5, 11, 8])
    together = backend.logits(handle, collate(exs, pad_id=0))
    for row, ex in enumerate(exs):
        alone = backend.logits(handle, collate([ex], pad_id=0))
        np.testing.assert_allclose(together[row, : len(ex)], alone[0], atol=1e-5, rtol=0)


def test_bf16_frozen_linears_give_the_same_loss_as_autocasting_fp32_ones(tiny_config):
    backend = create_backend("cpu", precision="bf16")
    cfg = load_config(tiny_config)
    batch = collate(examples([9, 14]), pad_id=0)
    handle = backend.load_model(cfg.model, "bf16")
    backend.attach_adapter(handle, cfg.adapter.model_copy(update={"type": "lora"}))
    base = handle.model.get_base_model()
    linears = [m for m in base.modules() if isinstance(m, torch.nn.Linear) and m is not base.get_output_embeddings()]
    assert all(m.weight.dtype == torch.bfloat16 for m in linears if not m.weight.requires_grad)
    assert all(p.dtype == torch.float32 for p in handle.model.parameters() if p.requires_grad)
    stored_bf16, _ = backend.loss_sum(handle, batch)

    reference = backend.load_model(cfg.model, "bf16")
    reference.autocast_dtype = None        # attach without the conversion...
    backend.attach_adapter(reference, cfg.adapter)
    reference.autocast_dtype = torch.bfloat16   # ...then compute under the same autocast
    reference.model.load_state_dict(handle.model.state_dict(), strict=False)
    with torch.no_grad():
        for name, p in reference.model.named_parameters():
            if p.requires_grad:
                p.copy_(dict(handle.model.named_parameters())[name])
    autocast_fp32, _ = backend.loss_sum(reference, batch)
    assert float(stored_bf16) == pytest.approx(float(autocast_fp32), rel=1e-6)
    assert _store_frozen_linears_in(base, torch.bfloat16) == 0      # idempotent
