"""Token ids and offsets as `encode_with_offsets` reads them from the Rust encodings are those of
`tokenizer(..., return_offsets_mapping=True)`, with and without the tokenizer's special tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mudpuppy.data.render import Rendered, render_chat
from mudpuppy.data.tokenize import encode_with_offsets

from .conftest import SAMPLES


@pytest.mark.parametrize("special", [False, True])
def test_ids_and_offsets_match_the_tokenizers_own_mapping(tok, special):
    tok.chat_template = tok.chat_template or "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    texts = [render_chat(tok, json.loads(line)["messages"])
             for line in (SAMPLES / "smart_home_train.jsonl").read_text().splitlines()[:50]]
    texts += ["", " leading space", "emoji \U0001f600 and accents: d\u00e9j\u00e0 vu", "<|im_end|> inside text"]
    got = encode_with_offsets(tok, [Rendered(t) for t in texts], special)
    want = tok(texts, add_special_tokens=special, return_offsets_mapping=True)
    assert len(got) == len(texts)
    for (ids, offsets), want_ids, want_off in zip(got, want["input_ids"], want["offset_mapping"]):
        assert list(ids) == want_ids
        assert np.array_equal(offsets, np.asarray(want_off, dtype=np.int64).reshape(-1, 2))
