"""Offsets from a byte-level BPE's token lengths (byte_offsets.py) are the Rust tokenizer's own, or not used."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, pre_tokenizers, processors

from mudpuppy.data import byte_offsets
from mudpuppy.data.byte_offsets import byte_lengths, fast_flat

from .test_encode_flat import texts_of


def rust(backend, texts):
    out = backend.encode_batch(texts, add_special_tokens=False)
    return [e.ids for e in out], [np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2) for e in out]


@pytest.fixture(autouse=True)
def fresh_tables():
    byte_offsets._TABLES.clear()
    yield
    byte_offsets._TABLES.clear()


def test_the_same_ids_and_offsets_as_the_rust_tokenizer_ascii_or_not(tok):
    texts = texts_of(tok) + ["", "tab\there", "  two spaces  ", "caf\u00e9", "\U0001f600", "<|im_start|>user\nhi"]
    ids, offsets, bounds = fast_flat(tok, tok._tokenizer, texts)
    want_ids, want_offsets = rust(tok._tokenizer, texts)
    for j in range(len(texts)):
        assert ids[bounds[j]:bounds[j + 1]].tolist() == want_ids[j]
        assert np.array_equal(offsets[bounds[j]:bounds[j + 1]], want_offsets[j]), texts[j]


def test_each_text_is_encoded_once_and_a_batch_without_ascii_text_is_left_to_the_usual_path(tok):
    fast_flat(tok, tok._tokenizer, texts_of(tok))                 # past the first batch's comparison
    seen = {"encode_batch": [], "encode_batch_fast": []}

    class Spy:
        def __init__(self, backend):
            self.backend = backend

        def __getattr__(self, name):
            method = getattr(self.backend, name)
            if name in seen:
                return lambda texts, **kw: seen[name].extend(texts) or method(texts, **kw)
            return method

    spy = Spy(tok._tokenizer)
    texts = ["plain text", "caf\u00e9 au lait", "more plain text"]
    ids, offsets, bounds = fast_flat(tok, spy, texts)
    assert seen == {"encode_batch_fast": ["plain text", "more plain text"], "encode_batch": ["caf\u00e9 au lait"]}
    want_ids, want_offsets = rust(tok._tokenizer, texts)
    assert ids.tolist() == sum(want_ids, []) and np.array_equal(offsets, np.concatenate(want_offsets))
    assert fast_flat(tok, spy, ["caf\u00e9", "\u00fcber"]) is None


def test_a_later_batch_reads_the_table_alone(tok, monkeypatch):
    texts = texts_of(tok)
    fast_flat(tok, tok._tokenizer, texts)                         # the first batch is checked against Rust
    monkeypatch.setattr(type(tok._tokenizer), "encode_batch", None, raising=False)
    ids, offsets, bounds = fast_flat(tok, tok._tokenizer, [t for t in texts if t.isascii()])
    assert bounds[-1] == len(ids) > 0


def test_lengths_that_do_not_add_up_get_the_rust_offsets(tok):
    table = byte_lengths(tok, tok._tokenizer)
    table[:] = 1                                                  # every token one byte long
    texts = [t for t in texts_of(tok) if t.isascii() and t]
    ids, offsets, bounds = fast_flat(tok, tok._tokenizer, texts)
    assert np.array_equal(offsets, np.concatenate(rust(tok._tokenizer, texts)[1]))


def test_a_table_that_disagrees_on_the_first_batch_turns_the_path_off(tok):
    """Lengths that add up to the text's but cut it in the wrong places: the first batch's comparison with
    the Rust offsets catches them, and the tokenizer's texts go to Rust from then on."""
    texts = ["turn on the lights please"]
    ids = tok._tokenizer.encode(texts[0], add_special_tokens=False).ids
    table = byte_lengths(tok, tok._tokenizer)
    longer = next(i for i in ids if table[i] > 1 and ids.count(i) == 1)
    other = next(i for i in ids if i != longer and ids.count(i) == 1)
    table[longer] -= 1
    table[other] += 1
    assert fast_flat(tok, tok._tokenizer, texts) is None
    assert byte_lengths(tok, tok._tokenizer) is None


def spec_with(tok, **changes) -> Tokenizer:
    spec = json.loads(tok._tokenizer.to_str())
    spec.update(changes)
    return Tokenizer.from_str(json.dumps(spec))


@pytest.mark.parametrize("change", [
    {"normalizer": {"type": "Lowercase"}},
    {"pre_tokenizer": json.loads(pre_tokenizers.ByteLevel(add_prefix_space=True).__getstate__())},
    {"pre_tokenizer": json.loads(pre_tokenizers.Whitespace().__getstate__())},
    {"post_processor": json.loads(processors.ByteLevel(trim_offsets=True).__getstate__())},
])
def test_tokenizers_outside_the_scheme_are_left_to_rust(tok, change):
    backend = spec_with(tok, **change)
    assert byte_offsets._eligible(tok._tokenizer)
    assert not byte_offsets._eligible(backend)


@pytest.mark.parametrize("change", [{"byte_fallback": True}, {"dropout": 0.1}])
def test_bpe_settings_that_change_token_strings_are_left_to_rust(tok, change):
    spec = json.loads(tok._tokenizer.to_str())
    spec["model"].update(change)
    assert not byte_offsets._eligible(Tokenizer.from_str(json.dumps(spec)))


def test_an_added_token_that_strips_spaces_is_left_to_rust(tok):
    spec = json.loads(tok._tokenizer.to_str())
    spec["added_tokens"][0]["lstrip"] = True
    assert not byte_offsets._eligible(Tokenizer.from_str(json.dumps(spec)))
