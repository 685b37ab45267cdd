"""Packing is exact on a real model: every example's logits in a packed row equal its logits alone."""

from __future__ import annotations

import numpy as np
import pytest

from mudpuppy.data import Batch, collate, collate_packed
from mudpuppy.errors import MudpuppyError

from ..conftest import random_examples

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from mudpuppy.backends.torch.backend import DevicePlan, TorchBackend, TorchModel

    backend = TorchBackend(DevicePlan("cpu", torch.device("cpu")))
    handles = {}
    for impl in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), attn_implementation=impl,
                                                     dtype=torch.float32)
        handles[impl] = TorchModel(model, None, str(tiny_model_dir))
    return backend, handles


def examples(lengths, seed=0):
    return random_examples(lengths, 300, seed)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_logits_equal_each_example_alone(tiny_models, impl):
    backend, handles = tiny_models
    handle = handles[impl]
    exs = examples([7, 13, 5, 20, 9])
    rows = [[exs[0], exs[1], exs[2]], [exs[3], exs[4]]]
    packed = backend.logits(handle, collate_packed(rows, pad_id=0))
    worst = 0.0
    for r, row in enumerate(rows):
        at = 0
        for ex in row:
            alone = backend.logits(handle, collate([ex], pad_id=0))[0]
            worst = max(worst, float(np.abs(packed[r, at : at + len(ex)] - alone).max()))
            at += len(ex)
    assert worst < 1e-5


def test_positions_alone_would_contaminate(tiny_models):
    """The negative control: without the block-diagonal mask the second example sees the first."""
    backend, handles = tiny_models
    exs = examples([9, 11])
    packed = collate_packed([exs], pad_id=0)
    unmasked = Batch(packed.input_ids, packed.labels, packed.attention_mask)   # no segment ids: plain causal
    leaky = backend.logits(handles["sdpa"], unmasked)[0, 9:]
    alone = backend.logits(handles["sdpa"], collate([exs[1]], pad_id=0))[0]
    assert np.abs(leaky - alone).max() > 1e-3


def test_packed_loss_equals_the_sum_of_losses_alone(tiny_models):
    backend, handles = tiny_models
    exs = examples([7, 13, 5, 20])
    with torch.no_grad():
        loss, n = backend.loss_sum(handles["sdpa"], collate_packed([exs[:3], exs[3:]], pad_id=0))
        parts = [backend.loss_sum(handles["sdpa"], collate([e], pad_id=0)) for e in exs]
    assert n == sum(p[1] for p in parts)
    assert float(loss) == pytest.approx(sum(float(p[0]) for p in parts), rel=1e-5)


def test_attention_without_4d_masks_refuses_packing():
    from mudpuppy.backends.torch.model.attention import packed_attention_mask

    with pytest.raises(MudpuppyError, match="data.packing needs an attention implementation"):
        packed_attention_mask(torch.ones(1, 4, dtype=torch.long), "flash_attention_2", torch.float32)


def test_mask_shapes_and_padding_rows_are_never_empty():
    from mudpuppy.backends.torch.model.attention import packed_attention_mask

    segments = torch.tensor([[1, 1, 2, 0, 0]])
    allowed = packed_attention_mask(segments, "sdpa", torch.float32)
    assert allowed.shape == (1, 1, 5, 5) and allowed.dtype == torch.bool
    assert allowed[0, 0].sum(-1).min() >= 1
    assert not allowed[0, 0, 2, :2].any() and allowed[0, 0, 1, 0]
    additive = packed_attention_mask(segments, "eager", torch.float32)
    assert additive[0, 0, 2, 2] == 0 and additive[0, 0, 2, 0] == torch.finfo(torch.float32).min


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_packing_is_exact_on_the_gpu_and_runs_under_bf16(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from mudpuppy.backends.torch.backend import DevicePlan, TorchBackend, TorchModel

    backend = TorchBackend(DevicePlan("cuda", torch.device("cuda")))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), attn_implementation="sdpa").to("cuda")
    exs = examples([7, 13, 5, 20])
    rows = [exs[:3], exs[3:]]
    for autocast, tol in ((None, 1e-4), (torch.bfloat16, 5e-2)):
        handle = TorchModel(model, None, str(tiny_model_dir), autocast)
        packed = backend.logits(handle, collate_packed(rows, pad_id=0))
        at = 0
        for ex in rows[0]:
            alone = backend.logits(handle, collate([ex], pad_id=0))[0]
            assert np.isfinite(packed).all()
            assert np.abs(packed[0, at : at + len(ex)] - alone).max() < tol
            at += len(ex)
