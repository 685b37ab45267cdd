"""The vocabulary written to GGUF: byte-level pre-tokenizers named as llama.cpp and transformers know
them, and a sentencepiece-style vocabulary whose scores make llama.cpp's merge-by-score tokenizer
(re-implemented here) cut text as the Hugging Face tokenizer does."""

from __future__ import annotations

import heapq
import json

import numpy as np
import pytest

from mudpuppy.errors import MudpuppyError
from mudpuppy.export import ExportRequest, export_model
from mudpuppy.export.gguf_vocab import LLAMA3_SPLIT, QWEN2_SPLIT, byte_level_pre

from ..conftest import _corpus

# No text starts with a space: there tokenizers' Metaspace adds no second U+2581 where sentencepiece and
# llama.cpp do, a difference between those libraries, not something the GGUF can carry.
TEXTS = ["turn on the lights", "café über 21  twice", "hello\nworld", "lock the front door please", "x"]


def spec_of(pre_tokenizer) -> dict:
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    return json.loads(tok.to_str())


def test_byte_level_pre_tokenizers_get_llama_cpp_names():
    from tokenizers import Regex, pre_tokenizers as pt
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    def split(pattern):
        return pt.Sequence([pt.Split(Regex(pattern), behavior="isolated"), pt.ByteLevel(add_prefix_space=False,
                                                                                          use_regex=False)])

    assert byte_level_pre(spec_of(pt.ByteLevel(add_prefix_space=False))) == "gpt-2"
    assert byte_level_pre(spec_of(pt.Sequence([pt.Digits(individual_digits=True),
                                               pt.ByteLevel(add_prefix_space=False)]))) == "smollm"
    assert byte_level_pre(spec_of(split(LLAMA3_SPLIT))) == "llama-bpe"
    assert byte_level_pre(spec_of(split(QWEN2_SPLIT))) == "qwen2"
    # the reader on the other side splits these names with the same patterns
    assert GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"] == LLAMA3_SPLIT
    assert GGUF_PRE_TOKENIZER_SPLITS["qwen2"] == QWEN2_SPLIT
    with pytest.raises(MudpuppyError, match="known: gpt-2"):
        byte_level_pre(spec_of(split(r"\w+|\s+")))
    with pytest.raises(MudpuppyError, match="prefix space"):
        byte_level_pre(spec_of(pt.ByteLevel(add_prefix_space=True)))


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    """A tiny Llama with a sentencepiece-style tokenizer: BPE with byte fallback, U+2581 for spaces."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"]
                                                           + byte_tokens))
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    hf = LlamaTokenizer(vocab=model["vocab"], merges=merges, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    path = tmp_path_factory.mktemp("spm-llama")
    hf.save_pretrained(path)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(hf), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                                 bos_token_id=1, eos_token_id=2)).save_pretrained(path)
    return path, hf


def llama_cpp_spm(text: str, tokens: list[str], scores: list[float], types: list[int], space_prefix: bool) -> list[int]:
    """llama.cpp's sentencepiece tokenizer (llm_tokenizer_spm): start from characters, repeatedly merge the
    adjacent pair whose concatenation is a token with the highest score (leftmost first), then map each
    piece to its token, or to its bytes' <0xNN> tokens."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] in (1, 4)}     # normal and user-defined
    text = (" " + text if space_prefix else text).replace(" ", "\u2581")
    pieces = list(text)
    nxt, prv = list(range(1, len(pieces) + 1)), list(range(-1, len(pieces) - 1))
    heap = []

    def push(left):
        right = nxt[left]
        if right < len(pieces):
            joined = pieces[left] + pieces[right]
            if joined in ids:
                heapq.heappush(heap, (-scores[ids[joined]], left, joined))

    for i in range(len(pieces) - 1):
        push(i)
    while heap:
        _, left, joined = heapq.heappop(heap)
        right = nxt[left]
        if right >= len(pieces) or pieces[left] + pieces[right] != joined or not pieces[left]:
            continue                                   # a stale pair: one side merged since
        pieces[left], pieces[right] = joined, ""
        nxt[left] = nxt[right]
        if nxt[right] < len(pieces):
            prv[nxt[right]] = left
        if prv[left] >= 0:
            push(prv[left])
        push(left)
    byte_ids = {t: i for i, t in enumerate(tokens) if types[i] == 6}
    out = []
    for piece in (p for p in pieces if p):
        out += [ids[piece]] if piece in ids else [byte_ids[f"<0x{b:02X}>"] for b in piece.encode("utf-8")]
    return out


def test_a_sentencepiece_style_vocabulary_tokenizes_as_llama_cpp_would(spm_model, tmp_path):
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, hf = spm_model
    export_model(ExportRequest(str(path), "gguf", str(tmp_path / "out"), quant="f32"), echo=lambda *_a, **_k: None)
    reader = gguf.GGUFReader(str(tmp_path / "out" / "model-f32.gguf"))
    field = lambda key: reader.fields[key].contents()   # noqa: E731
    assert field("tokenizer.ggml.model") == "llama" and field("tokenizer.ggml.add_space_prefix") is True
    tokens, scores = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.scores")
    types = field("tokenizer.ggml.token_type")
    assert types[:3] == [2, 3, 3] and types[3:259] == [6] * 256        # unk, <s>, </s>, then the bytes
    back = AutoTokenizer.from_pretrained(str(tmp_path / "out"), gguf_file="model-f32.gguf")
    for text in TEXTS:
        want = hf(text, add_special_tokens=False)["input_ids"]
        assert llama_cpp_spm(text, tokens, scores, types, space_prefix=True) == want, text
        assert back(text, add_special_tokens=False)["input_ids"] == want, text
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), gguf_file="model-f32.gguf",
                                                 dtype=torch.float32).eval()
    ids = torch.tensor([hf(TEXTS[0])["input_ids"]])
    with torch.no_grad():
        assert np.abs((model(input_ids=ids).logits - again(input_ids=ids).logits).numpy()).max() < 1e-5
