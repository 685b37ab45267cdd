"""Perplexity through llama.cpp's own evaluation (its logits over a text, teacher-forced) equals
mudpuppy's (the dequantized forward of tests/readers/dequantized.py over the same tokens) within 10%,
for every family at q8_0, q4_k_m and q2_k; and the file types order as their bits do."""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import ALL_FAMILIES, TEXT
from .cpp import READERS, load, logits
from .test_greedy import report
from .dequantized import dequantized_model

pytestmark = READERS
QUANTS = ["q8_0", "q4_k_m", "q2_k"]


def perplexity(scores: np.ndarray, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] under the logits at positions [:-1]."""
    s = scores[:-1].astype(np.float64)
    logp = s - s.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


def torch_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_llama_cpp_perplexity_equals_mudpuppys(models, family):
    model, tok, _, config = models.model(family)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    merged = perplexity(torch_logits(model, ids), ids)
    seen = {}
    for quant in QUANTS:
        path = models.gguf(family, quant)
        ours = perplexity(torch_logits(dequantized_model(family, model, config, path), ids), ids)
        theirs = perplexity(logits(load(path), ids), ids)
        seen[quant] = (ours, theirs)
        assert abs(np.log(theirs / ours)) < 0.1, (quant, ours, theirs)
        report(family, quant, merged, ours, theirs)
    # the rounding shows, more at 2 bits than at 8
    q8, q2 = (abs(np.log(seen[q][0] / merged)) for q in ("q8_0", "q2_k"))
    assert q2 > q8, (merged, seen)
