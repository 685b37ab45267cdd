"""A batch's masks from one search (`span_masks`) are every text's own (`span_mask`), whatever its spans:
none, several, touching, at the text's ends, texts of different lengths, added special tokens."""

from __future__ import annotations

import numpy as np
import pytest

from mudpuppy.data.render import Rendered
from mudpuppy.data.tokenize import encode_flat, span_masks

TEXTS = ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello there<|im_end|>\n",
         "short", "", "a much longer text than the others, so the widths differ " * 4,
         "emoji \U0001f600\U0001f600 and accents: d\u00e9j\u00e0 vu"]


def span_mask(starts: np.ndarray, real: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """One text's mask as it was computed before batches (52927f0's build_example): a token the tokenizer
    did not add carries loss when the last span starting at or before it has not ended."""
    if not spans:
        return np.zeros(len(starts), dtype=bool)
    lo = np.asarray([a for a, _ in spans])
    hi = np.asarray([b for _, b in spans])
    k = np.searchsorted(lo, starts, side="right") - 1
    return real & (k >= 0) & (starts < hi[np.maximum(k, 0)])


def spans_for(text: str, rng: np.random.Generator) -> list[tuple[int, int, str]]:
    cuts = sorted(rng.choice(len(text) + 1, size=min(len(text) + 1, int(rng.integers(0, 7))), replace=False).tolist())
    spans = [(a, b, "content" if rng.random() < 0.7 else "eos") for a, b in zip(cuts[::2], cuts[1::2])]
    if text and rng.random() < 0.3:
        spans.append((0, len(text), "content"))            # one span over everything, overlapping the rest
    return spans


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("policy", ["turn", "last", "none"])
def test_a_batch_of_masks_is_each_texts_own(tok, special, policy):
    rng = np.random.default_rng(0)
    for _ in range(40):
        items = [Rendered(t, spans_for(t, rng)) for t in rng.permutation(TEXTS).tolist()]
        ids, offsets, bounds = encode_flat(tok, items, special)
        masks = span_masks(items, offsets, bounds, policy)
        for j, item in enumerate(items):
            a, b = bounds[j], bounds[j + 1]
            starts, ends = offsets[a:b, 0], offsets[a:b, 1]
            assert np.array_equal(masks[a:b], span_mask(starts, ends > starts, item.trained_spans(policy))), item


def test_a_batch_without_spans_has_no_loss(tok):
    items = [Rendered(t) for t in TEXTS]
    ids, offsets, bounds = encode_flat(tok, items, True)
    assert not span_masks(items, offsets, bounds, "turn").any() and len(ids) == bounds[-1]
