"""Perplexity through llama.cpp's own evaluation (its logits over a text, teacher-forced) equals
mudpuppy's (the dequantized forward of conftest.Models.dequantized over the same tokens) for every
family at q8_0, q4_k_m and q2_k, and a 2-bit file moves it further from the merged model's than an
8-bit one.

Within 10.5% for dense models, 35% for mixtures of experts (0.1 and 0.3 in log perplexity): llama.cpp quantizes the activations to 8 bits
for quantized matrix products (test_greedy.py), and in a random MoE model that noise flips the router's
top-2 choice of experts at some positions (logits up to 4-13 apart there, against 0.6-0.9 in a dense
model). Measured on 2026-11-27: largest dense gap 10.3% (Phi-3 q4_k_m, 0.098), MoE 31% (Mixtral q4_k_m, 0.267);
docs/export.md#llamacpp-test-tier."""

from __future__ import annotations

import numpy as np
import pytest

from ..export.conftest import logits as torch_logits
from .conftest import ALL_FAMILIES, TEXT
from .cpp import READERS, load, logits
from .test_greedy import report

pytestmark = READERS
QUANTS = ["q8_0", "q4_k_m", "q2_k"]
MOE = ("qwen3moe", "mixtral", "gptoss")


def perplexity(scores: np.ndarray, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] under the logits at positions [:-1]."""
    s = scores[:-1].astype(np.float64)
    logp = s - s.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_llama_cpp_perplexity_equals_mudpuppys(models, family):
    model, tok, _, _ = models.model(family)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    merged = perplexity(torch_logits(model, ids), ids)
    seen = {}
    for quant in QUANTS:
        path = models.gguf(family, quant)
        ours = perplexity(torch_logits(models.dequantized(family, quant), ids), ids)
        theirs = perplexity(logits(load(path), ids), ids)
        seen[quant] = (ours, theirs)
        bound = 0.3 if family in MOE else 0.1          # |log ratio|: 35% and 10.5%
        assert abs(np.log(theirs / ours)) < bound, (quant, ours, theirs)
        report(family, quant, merged, ours, theirs)
    # the rounding shows, more at 2 bits than at 8
    q8, q2 = (abs(np.log(seen[q][0] / merged)) for q in ("q8_0", "q2_k"))
    assert q2 > q8, (merged, seen)
