"""Token ids and offsets as `encode_flat` reads them (from the Rust encodings, straight from the Rust tokenizer
or through transformers' call, or per text for a tokenizer without encodings) are those of
`tokenizer(..., return_offsets_mapping=True)`, with and without the tokenizer's special tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mudpuppy.data import tokenize
from mudpuppy.data.render import Rendered, render_chat
from mudpuppy.data.tokenize import direct_encoding, encode_flat

from .conftest import SAMPLES


def texts_of(tok) -> list[str]:
    tok.chat_template = tok.chat_template or "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    texts = [render_chat(tok, json.loads(line)["messages"])
             for line in (SAMPLES / "smart_home_train.jsonl").read_text().splitlines()[:50]]
    return texts + ["", " leading space", "emoji \U0001f600 and accents: d\u00e9j\u00e0 vu", "<|im_end|> inside text"]


@pytest.mark.parametrize("path", ["byte lengths", "direct", "transformers", "no encodings"])
@pytest.mark.parametrize("special", [False, True])
def test_ids_and_offsets_match_the_tokenizers_own_mapping(tok, special, path, monkeypatch):
    texts = texts_of(tok)
    assert direct_encoding(tok, tok._tokenizer)          # the tiny tokenizer takes the direct path by default
    # ... and, a byte-level BPE, offsets from its tokens' byte lengths where no special tokens are added
    assert (tokenize.byte_level_flat(tok, texts, special) is not None) == (not special)
    if path != "byte lengths":
        monkeypatch.setattr(tokenize, "byte_level_flat", lambda *a: None)
    if path == "transformers":
        monkeypatch.setattr(tokenize, "direct_encoding", lambda *a: False)
    elif path == "no encodings":
        monkeypatch.setattr(tokenize, "rust_encodings", lambda *a: None)
    ids, offsets, bounds = encode_flat(tok, [Rendered(t) for t in texts], special)
    want = tok(texts, add_special_tokens=special, return_offsets_mapping=True)
    assert len(bounds) == len(texts) + 1 and bounds[0] == 0 and bounds[-1] == len(ids) == len(offsets)
    assert ids.dtype == np.int32 and offsets.dtype == np.int64
    for j, (want_ids, want_off) in enumerate(zip(want["input_ids"], want["offset_mapping"])):
        a, b = bounds[j], bounds[j + 1]
        assert ids[a:b].tolist() == want_ids
        assert np.array_equal(offsets[a:b], np.asarray(want_off, dtype=np.int64).reshape(-1, 2))


def test_settings_on_the_rust_tokenizer_send_the_texts_through_transformers(tok):
    """Truncation set on the backend (transformers' call would lift it first) or special tokens to be split:
    the direct path is not taken, and the ids are still those of the tokenizer's own call."""
    texts = texts_of(tok)
    tok._tokenizer.enable_truncation(5)
    assert not direct_encoding(tok, tok._tokenizer)
    ids, _, bounds = encode_flat(tok, [Rendered(t) for t in texts], False)
    assert [ids[a:b].tolist() for a, b in zip(bounds, bounds[1:])] == tok(texts, add_special_tokens=False)["input_ids"]
    assert max(np.diff(bounds)) > 5                                  # not truncated
    tok._tokenizer.no_truncation()
    tok.split_special_tokens = True
    assert not direct_encoding(tok, tok._tokenizer)
    ids, _, bounds = encode_flat(tok, [Rendered("<|im_end|> inside text")], False)
    assert ids.tolist() == tok("<|im_end|> inside text", add_special_tokens=False)["input_ids"]
