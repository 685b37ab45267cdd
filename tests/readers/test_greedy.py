"""llama.cpp reads every family mudpuppy exports, at every quant type mudpuppy writes, and computes what
mudpuppy's dequantized forward computes (the source model with the file's own weights,
conftest.Models.dequantized): the logits over the prompt and the reference's greedy answer agree to a
median difference under TOLERANCE, and the greedy tokens are equal up to the first step where the
reference's two best tokens are closer than twice the largest difference llama.cpp showed on that
prompt (there its arithmetic may break the tie the other way, and what follows differs).

The differences are llama.cpp's arithmetic, not the file: for f16 matrices ggml rounds the activations
to f16 before the product; for quantized ones (q8_0, q4_0 and the K-quants, fallbacks included) it
quantizes them to 8 bits (Q8_0 / Q8_K blocks), about 0.5% of each activation, which these random models
(weights of std 0.2, 4 layers) amplify: median 0.35-1.25, largest 0.6-4 in logits up to 15 (Phi-3 the
most; measured, docs/export.md#llamacpp-test-tier). A file read with a wrong layout or type is off by
several units everywhere (the merged float32 model is 13-17 from a Q4_K_M's dequantized one at its worst
position, 3-5 at the median)."""

from __future__ import annotations

import numpy as np
import pytest

from ..export.conftest import logits as torch_logits
from .conftest import ALL_FAMILIES, TEXT
from .cpp import K_QUANTS, READERS, greedy, load, logits

pytestmark = READERS
QUANTS = ["f16", "q8_0", "q4_0", *K_QUANTS]
NEW_TOKENS = 8
TOLERANCE = {"f16": 0.1}          # median |difference|; others: QUANTIZED_ACTIVATIONS
QUANTIZED_ACTIVATIONS = 2.0


def torch_greedy(model, ids: list[int], n: int, pad: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad)
    return out[0, len(ids):].tolist()


def comparable_steps(reference: np.ndarray, start: int, n: int, spread: float) -> int:
    """How many greedy steps from position `start` llama.cpp must agree on: up to the first whose two
    best reference logits are within 2 * spread (a tie llama.cpp's arithmetic may break the other way)."""
    for step in range(n):
        top2 = np.sort(reference[start + step])[-2:]
        if top2[1] - top2[0] <= 2 * spread:
            return step
    return n


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_llama_cpp_computes_as_the_dequantized_model(models, family, quant):
    _, tok, _, _ = models.model(family)
    path = models.gguf(family, quant)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    reference = models.dequantized(family, quant)
    want = torch_greedy(reference, ids, NEW_TOKENS, tok.pad_token_id)
    tolerance = TOLERANCE.get(quant, QUANTIZED_ACTIVATIONS)
    llm = load(path)
    theirs, ours = logits(llm, ids + want), torch_logits(reference, ids + want)
    diff = np.abs(theirs - ours)
    assert np.median(diff) < tolerance, (quant, float(np.median(diff)), float(diff.max()))
    steps = comparable_steps(ours, len(ids) - 1, NEW_TOKENS, float(diff.max()))
    got = greedy(llm, ids, NEW_TOKENS)
    assert got[:steps] == want[:steps], steps
    report(family, quant, float(np.median(diff)), float(diff.max()), steps, sum(a == b for a, b in zip(got, want)))


def report(*row) -> None:
    """One line per test to $READERS_REPORT, where set: what docs/export.md's table is made from."""
    import os

    if os.environ.get("READERS_REPORT"):
        with open(os.environ["READERS_REPORT"], "a") as fh:
            fh.write("\t".join(str(v) for v in row) + "\n")
