"""The tokenizer as GGUF metadata: the vocabulary, merges, special ids and the chat template.

Written from the tokenizer the model was trained with (its `tokenizer.json`, as the
fast tokenizer holds it), under llama.cpp's keys, the way llama.cpp's
convert_hf_to_gguf.py writes them:

    byte-level BPE (GPT-2 style: SmolLM2, Llama 3, Qwen2/3, gpt-oss)  tokenizer.ggml.model = "gpt2"
        tokens in their byte-level spelling, merges, and `tokenizer.ggml.pre`, the
        pre-tokenizer llama.cpp must split text with. llama.cpp identifies it by hashing
        a tokenization; here it is read from the tokenizer's own description, and a
        pre-tokenizer this table does not know is an error, never a guess.
    sentencepiece-style BPE with byte fallback (Llama 2, Mistral v0.1, TinyLlama)
        tokenizer.ggml.model = "llama": tokens spelled with U+2581 for spaces, byte
        tokens <0xNN>, and scores from the merge ranks (llama.cpp merges by score).

Unigram and WordPiece vocabularies are not written: a clear error says so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..errors import MudpuppyError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The Split regexes of the byte-level tokenizers llama.cpp knows by name (their tokenizer.json spell them so).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (GPT-4o, gpt-oss): the regex llama-vocab.cpp quotes as "original regex from tokenizer.json"
GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
               r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_PRE = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2", GPT4O_SPLIT: "gpt-4o"}
KNOWN_PRE = ("gpt-2 (a plain ByteLevel pre-tokenizer)", "smollm (digits split one by one, then ByteLevel)",
             "llama-bpe (Llama 3's split regex)", "qwen2 (Qwen2 and Qwen3's split regex)",
             "gpt-4o (the o200k split regex of GPT-4o and gpt-oss)")

_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


@dataclass
class Vocab:
    model: str                          # tokenizer.ggml.model: gpt2 | llama
    pre: str | None                     # tokenizer.ggml.pre (gpt2 only)
    tokens: list[str]
    types: list[int]
    scores: list[float] | None          # llama only
    merges: list[str]
    special_ids: dict[str, int] = field(default_factory=dict)   # bos, eos, unk, pad, eot
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str | None = None

    def describe(self) -> str:
        kind = f"{self.model}" + (f"/{self.pre}" if self.pre else "")
        return f"{kind} vocabulary of {len(self.tokens)} tokens, {len(self.merges)} merges"


def build_vocab(tokenizer, vocab_size: int, chat_template: str | None, eot_id: int | None = None) -> Vocab:
    """The GGUF vocabulary of `tokenizer` for a model whose embedding has `vocab_size` rows."""
    spec = tokenizer_spec(tokenizer)
    model = spec["model"]
    kind = tokenizer_kind(spec)
    held = len(tokenizer)
    if held > vocab_size:
        raise MudpuppyError(f"the tokenizer holds {held} tokens but the model embeds only {vocab_size}; "
                            "the exported model could not look up the extra ones")
    merges = merge_strings(model.get("merges") or [])
    if kind == "gpt2":
        tokens, types = gpt2_tokens(tokenizer, vocab_size)
        vocab = Vocab("gpt2", byte_level_pre(spec), tokens, types, None, merges)
    else:
        tokens, types, scores = llama_tokens(tokenizer, vocab_size, model)
        vocab = Vocab("llama", None, tokens, types, scores, merges, add_space_prefix=adds_space_prefix(spec))
    ids = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "unk": tokenizer.unk_token_id,
           "pad": tokenizer.pad_token_id, "eot": eot_id}
    vocab.special_ids = {k: int(v) for k, v in ids.items() if v is not None and 0 <= v < vocab_size}
    vocab.add_bos, vocab.add_eos = added_specials(tokenizer)
    vocab.chat_template = chat_template
    return vocab


def tokenizer_spec(tokenizer) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise MudpuppyError(f"the tokenizer ({type(tokenizer).__name__}) has no tokenizer.json (not a fast "
                            "tokenizer); GGUF export reads the vocabulary from a fast tokenizer")
    return json.loads(backend.to_str())


def tokenizer_kind(spec: dict) -> str:
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise MudpuppyError(f"the tokenizer is a {model.get('type')} model; GGUF export writes BPE vocabularies "
                            "only (byte-level BPE as GPT-2/Llama 3/Qwen2/SmolLM2 use, or sentencepiece-style "
                            "BPE with byte fallback as Llama 2/Mistral use)")
    if model.get("byte_fallback"):
        return "llama"
    if _find(spec.get("pre_tokenizer"), "ByteLevel"):
        return "gpt2"
    raise MudpuppyError("the tokenizer is a BPE model with neither byte fallback nor a ByteLevel pre-tokenizer; "
                        "GGUF export cannot tell llama.cpp how to split text for it")


def byte_level_pre(spec: dict) -> str:
    """tokenizer.ggml.pre for a byte-level BPE, read from the tokenizer's pre-tokenizer."""
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    byte_level = parts[-1] if kinds and kinds[-1] == "ByteLevel" else None
    if byte_level is not None and byte_level.get("add_prefix_space"):
        raise MudpuppyError("the tokenizer's ByteLevel pre-tokenizer adds a prefix space, which llama.cpp's "
                            "byte-level tokenizer does not do; GGUF export would change how text is tokenized")
    if kinds == ["ByteLevel"] and byte_level.get("use_regex", True):
        return "gpt-2"
    if (kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits")
            and byte_level.get("use_regex", True)):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not byte_level.get("use_regex", True):
        pattern = (parts[0].get("pattern") or {}).get("Regex")
        if pattern in SPLIT_PRE and parts[0].get("behavior") == "Isolated":
            return SPLIT_PRE[pattern]
    raise MudpuppyError(f"the tokenizer's pre-tokenizer ({json.dumps(pre)[:300]}) is not one GGUF export knows how "
                        f"to name for llama.cpp; known: {'; '.join(KNOWN_PRE)}")


def adds_space_prefix(spec: dict) -> bool:
    """Sentencepiece style: spaces become U+2581, and a leading one is added (or not)."""
    normalizer, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
    meta = _find(pre, "Metaspace")
    if meta is not None:
        return meta.get("prepend_scheme", "always") in ("always", "first") or bool(meta.get("add_prefix_space"))
    replaces = _find(normalizer, "Replace")
    if replaces is None or (replaces.get("content") != "\u2581"):
        raise MudpuppyError("a byte-fallback BPE tokenizer whose spaces are not written as U+2581 (no Metaspace "
                            "pre-tokenizer or Replace normalizer); llama.cpp's sentencepiece tokenizer would "
                            "split its text differently")
    prepend = _find(normalizer, "Prepend")
    return prepend is not None and prepend.get("prepend") == "\u2581"


def _find(node: dict | None, kind: str) -> dict | None:
    """The first component of type `kind` in a tokenizers normalizer / pre-tokenizer tree."""
    if not node:
        return None
    if node.get("type") == kind:
        return node
    for child in node.get("pretokenizers") or node.get("normalizers") or []:
        found = _find(child, kind)
        if found is not None:
            return found
    return None


def merge_strings(merges: list) -> list[str]:
    """Merges as "left right" strings. tokenizer.json's newer list form may hold a space inside a
    part; it is written as chr(ord(" ") + 256), as gguf's SpecialVocab (and so llama.cpp) does."""
    out = []
    for merge in merges:
        if isinstance(merge, str):
            out.append(merge)
        else:
            out.append(" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in merge))
    return out


def gpt2_tokens(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """As llama.cpp's get_vocab_base: the byte-level spelling of each id, added tokens as written,
    control (special) or user-defined; ids the tokenizer lacks are [PADn] placeholders."""
    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(CONTROL if added[i].special else USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(NORMAL)
    return tokens, types


def llama_tokens(tokenizer, vocab_size: int, model: dict) -> tuple[list[str], list[int], list[float]]:
    """Sentencepiece-style pieces with scores: a token made by merge number r scores -r, so
    llama.cpp's highest-score-first merging reproduces the BPE merge order; other pieces score
    below every merge (bytes and control tokens 0, as sentencepiece writes them)."""
    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    rank: dict[str, int] = {}
    for r, merge in enumerate(merge_strings(model.get("merges") or [])):
        left, right = merge.split(" ", 1)
        rank.setdefault(left + right, r)
    unk = tokenizer.unk_token_id
    floor = -float(len(rank) + 1)
    tokens, types, scores = [], [], []
    for i in range(vocab_size):
        text = reverse.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            scores.append(floor)
            continue
        tokens.append(text)
        if i == unk:
            types.append(UNKNOWN)
            scores.append(0.0)
        elif i in added:
            types.append(CONTROL if added[i].special else USER_DEFINED)
            scores.append(0.0)
        elif _BYTE_TOKEN.match(text):
            types.append(BYTE)
            scores.append(0.0)
        else:
            types.append(NORMAL)
            scores.append(-float(rank[text]) if text in rank else floor)
    return tokens, types, scores


def added_specials(tokenizer) -> tuple[bool, bool]:
    """Whether encoding plain text adds BOS / EOS, found by encoding it (what the model saw)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    add_bos = bos is not None and len(full) > len(plain) and full[0] == bos and full[1:1 + len(plain)] == plain
    add_eos = eos is not None and len(full) > len(plain) and full[-1] == eos and full[-1 - len(plain):-1] == plain
    return add_bos, add_eos
