"""Character offsets of a byte-level BPE tokenizer's tokens without asking the Rust tokenizer for them.

Masks need every token's character offsets (`tokenize.span_masks`). The Rust tokenizer's `encode_batch`
computes them, and spends about a fifth of its time turning its byte offsets into character offsets (a
map entry per byte of the text), then Python spends as long again reading them back as tuples.
For a byte-level BPE tokenizer (GPT-2's scheme: SmolLM2, Llama 3, Qwen, Mistral's recent ones) with no
normalizer and nothing that trims offsets, a text's tokens cover its bytes one after the other, each
exactly the bytes its vocabulary string stands for (one byte per character of the byte-level alphabet;
an added token, its content's UTF-8 bytes). So `encode_batch_fast` (the same ids, no offsets) and a
table of each id's byte length give the byte offsets, which are the character offsets of an ASCII text.

Where that is not certain it is not used: a tokenizer outside that description, a text that is not
ASCII (encoded by `encode_batch` alone, not twice), or a text whose tokens' lengths do not add up to its
own length gets the Rust offsets; and the
first batch a process encodes this way is also encoded the usual way and compared, offsets and ids,
so a tokenizer this reasoning misjudges falls back for good.
"""

from __future__ import annotations

import json
from itertools import chain

import numpy as np

_TABLES: dict[int, tuple] = {}   # id(tokenizer) -> (tokenizer, vocabulary size, table or None, checked)


def byte_lengths(tokenizer, backend) -> np.ndarray | None:
    """Each token id's length in bytes, where `backend` (the Rust tokenizer) is a byte-level BPE whose
    offsets are those lengths laid end to end; None otherwise. Computed once per tokenizer."""
    size = backend.get_vocab_size(with_added_tokens=True)
    hit = _TABLES.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer and hit[1] == size:
        return hit[2]
    table = _table(backend) if _eligible(backend) else None
    if len(_TABLES) > 8:
        _TABLES.clear()
    _TABLES[id(tokenizer)] = (tokenizer, size, table, False)
    return table


def _eligible(backend) -> bool:
    model = backend.model
    if type(model).__name__ != "BPE" or model.byte_fallback or model.dropout \
            or model.continuing_subword_prefix or model.end_of_word_suffix:
        return False
    if backend.normalizer is not None or not _byte_level(_state(backend.pre_tokenizer)):
        return False
    if not _untrimmed(_state(backend.post_processor)):
        return False
    return all(not (t.lstrip or t.rstrip or t.single_word) for t in backend.get_added_tokens_decoder().values())


def _state(part) -> dict | None:
    """A pre-tokenizer's or post-processor's settings, as tokenizer.json writes them."""
    return None if part is None else json.loads(part.__getstate__())


def _byte_level(pre) -> bool:
    """A ByteLevel pre-tokenizer adding no space, alone or after Split/Digits steps (which only cut)."""
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers", [])
        return bool(steps) and _byte_level(steps[-1]) and all(
            s.get("type") in ("Split", "Digits") and s.get("behavior", "Isolated") != "Removed" for s in steps[:-1])
    return pre.get("type") == "ByteLevel" and not pre.get("add_prefix_space")


def _untrimmed(post) -> bool:
    """A post-processor that leaves offsets as they are (ByteLevel's trim_offsets moves them)."""
    if post is None:
        return True
    if post.get("type") == "Sequence":
        return all(_untrimmed(p) for p in post.get("processors", []))
    if post.get("type") == "ByteLevel":
        return not post.get("trim_offsets")
    return post.get("type") in ("TemplateProcessing", "BertProcessing", "RobertaProcessing") \
        and not post.get("trim_offsets")


def _table(backend) -> np.ndarray:
    vocab = backend.get_vocab(with_added_tokens=False)
    table = np.zeros(backend.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for token, i in vocab.items():
        table[i] = len(token)                    # one byte per character of the byte-level alphabet
    for i, added in backend.get_added_tokens_decoder().items():
        table[i] = len(added.content.encode("utf-8"))
    return table


def fast_flat(tokenizer, backend, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """`tokenize.encode_flat`'s (ids, offsets, bounds) for texts encoded without special tokens: ASCII texts
    through `encode_batch_fast` with offsets from `byte_lengths`, the others through `encode_batch` with the
    Rust offsets (each text is encoded once); None: not this tokenizer, or no ASCII text in the batch."""
    table = byte_lengths(tokenizer, backend)
    plain = [t.isascii() for t in texts]
    if table is None or not any(plain):
        return None
    others = [t for t, p in zip(texts, plain) if not p]
    fast = iter(backend.encode_batch_fast([t for t, p in zip(texts, plain) if p], add_special_tokens=False))
    full = iter(backend.encode_batch(others, add_special_tokens=False) if others else ())
    encodings = [next(fast) if p else next(full) for p in plain]
    bounds = np.zeros(len(encodings) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in encodings], out=bounds[1:])
    total = int(bounds[-1])
    ids = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype=np.int32, count=total)
    lengths = table[ids]
    ends = np.cumsum(lengths)
    before = np.zeros(len(texts), dtype=np.int64)          # bytes of the earlier texts' tokens
    filled = bounds[:-1] > 0
    before[filled] = ends[bounds[:-1][filled] - 1]
    ends -= np.repeat(before, np.diff(bounds))
    offsets = np.stack([ends - lengths, ends], axis=1)
    last = np.where(bounds[1:] > bounds[:-1], ends[np.maximum(bounds[1:] - 1, 0)], 0) if total else \
        np.zeros(len(texts), dtype=np.int64)
    wrong = [j for j, t in enumerate(texts) if plain[j] and last[j] != len(t)]   # lengths that do not add up
    exact = dict(zip(wrong, backend.encode_batch([texts[j] for j in wrong], add_special_tokens=False))) \
        if wrong else {}
    for j in [j for j, p in enumerate(plain) if not p] + wrong:
        e = exact.get(j, encodings[j])
        if len(e) != bounds[j + 1] - bounds[j]:       # not the same tokens: never seen; trust neither
            return None
        offsets[bounds[j]:bounds[j + 1]] = np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2)
    if not _checked(tokenizer, backend, texts, ids, offsets, bounds):
        return None
    return ids, offsets, bounds


def _checked(tokenizer, backend, texts, ids, offsets, bounds) -> bool:
    """On a process's first batch: the Rust tokenizer's own ids and offsets, compared; a difference turns
    this path off for the tokenizer."""
    hit = _TABLES[id(tokenizer)]
    if hit[3]:
        return True
    full = backend.encode_batch(texts, add_special_tokens=False)
    want_ids = np.fromiter(chain.from_iterable(e.ids for e in full), dtype=np.int32)
    want = np.fromiter(chain.from_iterable(chain.from_iterable(e.offsets for e in full)), dtype=np.int64)
    same = np.array_equal(want_ids, ids) and np.array_equal(want.reshape(-1, 2), offsets)
    _TABLES[id(tokenizer)] = (hit[0], hit[1], hit[2] if same else None, True)
    return same
