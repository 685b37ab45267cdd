"""Rendered text to token ids and loss masks; records of any format to examples.

A token carries loss when it starts inside a trained character span (see
`render.py`). Texts are tokenized in batches with offsets, which fast
tokenizers compute in Rust (a byte-level BPE's come from its tokens' byte
lengths instead: `byte_offsets.py`); a tokenizer without offsets falls back to
tokenizing the text piece by piece, cut at the span boundaries.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import chain
from typing import Callable

import numpy as np

from .byte_offsets import fast_flat
from .examples import AnyExample, Example, ImageExample, LabeledExample, PairExample, PromptExample, StepExample
from .readers import Record, record_error
from .render import (
    Rendered, RenderOptions, instruction_prompt, render_chat, render_conversation, render_prompt_only,
    render_prompt_response, render_steps, render_text, trained_flags,
)
from .templates import require_chat_template
from .tools import BUILTIN_TOOL_FORMATS, RecordError, resolve_tool_format, to_builtin_format, uses_tools
from .vision import expand_images, is_vision_tokenizer

BATCH = 512   # texts per tokenizer call: large enough to use the Rust threads, small enough to stay lean


def tokenize_rendered(tokenizer, items: list[Rendered], train_on_eos: str = "turn",
                      sources: list[str] | None = None) -> list[Example]:
    """One Example per rendered text, masks from its trained spans under the EOS policy.

    Each batch is encoded in one call and read back as flat arrays (ids, offsets, each text's bounds);
    the masks of the whole batch come from one search of its tokens' starts among its spans
    (`span_masks`), and every example's arrays are slices of the batch's."""
    sources = sources or [""] * len(items)
    out: list[Example | None] = [None] * len(items)
    eos = tokenizer.eos_token_id
    for flag in (False, True):
        idx = [i for i, r in enumerate(items) if r.add_special_tokens == flag]
        for start in range(0, len(idx), BATCH):
            chunk = idx[start : start + BATCH]
            batch = [items[i] for i in chunk]
            ids, offsets, bounds = encode_flat(tokenizer, batch, flag)
            masks = span_masks(batch, offsets, bounds, train_on_eos)
            for i, a, b in zip(chunk, bounds[:-1].tolist(), bounds[1:].tolist()):
                item = items[i]
                if item.anchors or item.blocked or item.append_eos or item.images:
                    out[i] = build_example(eos, item, ids[a:b], offsets[a:b], train_on_eos, sources[i], masks[a:b])
                else:                         # a chat's text: its slices of the batch are its example
                    out[i] = Example(ids[a:b], masks[a:b], sources[i])
    return out  # type: ignore[return-value]


def encode_flat(tokenizer, items: list[Rendered], add_special_tokens: bool
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The texts' ids (int32 [T]) and character offsets ([T, 2]) one after the other, and where each
    text's tokens begin ([n + 1]: text j holds tokens bounds[j]:bounds[j + 1])."""
    texts = [r.text for r in items]
    flat = byte_level_flat(tokenizer, texts, add_special_tokens)
    if flat is not None:
        return flat
    encodings = rust_encodings(tokenizer, texts, add_special_tokens)
    if encodings is None:
        pairs = encode_with_offsets(tokenizer, items, add_special_tokens)
        bounds = np.zeros(len(pairs) + 1, dtype=np.int64)
        np.cumsum([len(ids) for ids, _ in pairs], out=bounds[1:])
        ids = np.fromiter(chain.from_iterable(ids for ids, _ in pairs), dtype=np.int32, count=int(bounds[-1]))
        offsets = np.concatenate([off for _, off in pairs]) if pairs else np.zeros((0, 2), dtype=np.int64)
        return ids, offsets.reshape(-1, 2), bounds
    bounds = np.zeros(len(encodings) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in encodings], out=bounds[1:])
    total = int(bounds[-1])
    ids = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype=np.int32, count=total)
    offsets = np.fromiter(chain.from_iterable(chain.from_iterable(e.offsets for e in encodings)),
                          dtype=np.int64, count=2 * total).reshape(-1, 2)
    return ids, offsets, bounds


def byte_level_flat(tokenizer, texts: list[str], add_special_tokens: bool
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """`encode_flat`'s arrays with offsets from the tokens' byte lengths (byte_offsets.py), for texts without
    special tokens sent straight to a byte-level BPE Rust tokenizer; None where that does not apply."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if add_special_tokens or not getattr(tokenizer, "is_fast", False) or not direct_encoding(tokenizer, backend):
        return None
    return fast_flat(tokenizer, backend, texts)


def rust_encodings(tokenizer, texts: list[str], add_special_tokens: bool) -> list | None:
    """The Rust encodings of `texts`, as `tokenizer(texts, add_special_tokens=...)` computes them; None for a
    tokenizer that gives none (slow tokenizers). Where transformers' call would only hand the texts to the
    Rust tokenizer's `encode_batch` (its own class's call, no truncation, padding or special-token splitting
    to set up first), they go there directly: the call's conversion of every encoding into Python lists
    (ids, attention mask) is skipped."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if direct_encoding(tokenizer, backend):
        return backend.encode_batch(texts, add_special_tokens=add_special_tokens)
    enc = tokenizer(texts, add_special_tokens=add_special_tokens, return_attention_mask=False,
                    return_token_type_ids=False)
    return enc.encodings if enc.encodings is not None and len(enc.encodings) == len(texts) else None


def direct_encoding(tokenizer, backend) -> bool:
    """Whether `tokenizer(texts)` would be exactly `backend.encode_batch(texts)` (transformers 5's fast
    tokenizer call, unchanged by the tokenizer's class, with nothing set on the backend to undo)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    cls = type(tokenizer)
    return (isinstance(tokenizer, TokenizersBackend) and backend is not None
            and all(getattr(cls, name) is getattr(TokenizersBackend, name)
                    for name in ("__call__", "_encode_plus", "set_truncation_and_padding"))
            and backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False)))


def encode_with_offsets(tokenizer, items: list[Rendered], add_special_tokens: bool) -> list[tuple[list[int], np.ndarray]]:
    """(ids, character offsets [T, 2]) per rendered text, for a tokenizer that gives no Rust encodings:
    the offset mapping its call returns, or, where it computes none, `encode_by_pieces`."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer([r.text for r in items], add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return [(ids, np.asarray(off, dtype=np.int64).reshape(-1, 2))
                for ids, off in zip(enc["input_ids"], enc["offset_mapping"])]
    return [encode_by_pieces(tokenizer, r, add_special_tokens) for r in items]


def encode_by_pieces(tokenizer, item: Rendered, add_special_tokens: bool) -> tuple[list[int], np.ndarray]:
    """Offsets for a tokenizer that computes none: cut the text at every span boundary and
    tokenize the pieces apart, each token attributed to the start of its piece. Token
    boundaries at the cuts may differ from whole-text tokenization; masks are exact."""
    text = item.text
    cuts = {0, len(text)} | {a for a, _, _ in item.spans} | {b for _, b, _ in item.spans}
    cuts |= {c + 1 for c in item.anchors} | {c for span in item.blocked for c in span}
    bounds = sorted(c for c in cuts if 0 <= c <= len(text))
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    if add_special_tokens:
        prefix = tokenizer("", add_special_tokens=True)["input_ids"]
        ids += prefix
        offsets += [(0, 0)] * len(prefix)
    for a, b in zip(bounds, bounds[1:]):
        piece_ids = tokenizer(text[a:b], add_special_tokens=False)["input_ids"]
        ids += piece_ids
        offsets += [(a, b)] * len(piece_ids)
    return ids, np.asarray(offsets, dtype=np.int64).reshape(-1, 2)


def span_masks(items: list[Rendered], offsets: np.ndarray, bounds: np.ndarray, train_on_eos: str) -> np.ndarray:
    """Every text of a batch's trained-span mask at once (a token the tokenizer did not add carries loss
    where it starts inside a span): each token's start and each span are keyed by their
    text (text j's characters become j * width + c), so one sorted search over the batch finds for each
    token the last span that starts at or before it, which is its own text's or, where its text has none
    before it, an earlier text's, which ends before it."""
    spans = [item.trained_spans(train_on_eos) for item in items]
    counts = [len(s) for s in spans]
    starts, ends = offsets[:, 0], offsets[:, 1]
    if not sum(counts):
        return np.zeros(len(starts), dtype=bool)
    width = max(max(len(item.text) for item in items), int(ends.max(initial=0))) + 1
    flat = np.asarray([ab for s in spans for ab in s], dtype=np.int64).reshape(-1, 2)
    span_base = np.repeat(np.arange(len(items), dtype=np.int64) * width, counts)
    lo, hi = flat[:, 0] + span_base, flat[:, 1] + span_base
    key = starts + np.repeat(np.arange(len(items), dtype=np.int64) * width, np.diff(bounds))
    k = np.searchsorted(lo, key, side="right") - 1
    return (ends > starts) & (k >= 0) & (key < hi[np.maximum(k, 0)])


def build_example(eos: int | None, item: Rendered, ids: np.ndarray, offsets: np.ndarray,
                  train_on_eos: str, source: str, mask: np.ndarray) -> Example:
    """The example of one text from its ids, offsets and trained-span mask (`span_masks`): PRM anchors,
    image runs and the appended EOS applied to it."""
    ids_arr = np.asarray(ids, dtype=np.int32)
    starts, ends = offsets[:, 0], offsets[:, 1]
    real = ends > starts                      # special tokens added by the tokenizer have empty offsets
    if item.anchors:
        mask = np.zeros(len(ids_arr), dtype=bool)
        real_idx = np.flatnonzero(real)
        at = np.searchsorted(starts[real_idx], np.asarray(item.anchors), side="right") - 1
        mask[real_idx[at]] = True
    for a, b in item.blocked:                 # image runs never carry loss, whatever turn holds them
        mask = mask & ~((starts < b) & (ends > a))
    if item.append_eos and eos is not None and (len(ids_arr) == 0 or ids_arr[-1] != eos):
        ids_arr = np.append(ids_arr, np.int32(eos))
        mask = np.append(mask, train_on_eos != "none")
    if item.images:
        image_end = int((starts < max(b for _, b in item.blocked)).sum())
        return ImageExample(ids_arr, mask, source, item.images, image_end)
    return Example(ids_arr, mask, source)


# --------------------------------------------------------------------------- formats

def tokenize_records(tokenizer, fmt: str, records: list[Record], opts: RenderOptions,
                     name: str) -> list[AnyExample]:
    """One example per record, of the type the format calls for (see `examples.py`)."""
    if needs_template(fmt, records, opts):
        require_chat_template(tokenizer, name)
        opts = replace(opts, tool_format=tool_format_for(tokenizer, opts, records))
    render, assemble = _FORMATS[fmt]
    sources = [f"{name}:{r.line}" if r.line is not None else f"{name} row {r.row}" for r in records]
    vision = is_vision_tokenizer(tokenizer)
    rendered = []
    for r in records:
        try:
            item = render(tokenizer, r.data, opts)
            rendered.append(expand_images(tokenizer, item, r.data) if vision and fmt == "chat" else item)
        except RecordError as exc:
            raise record_error(name, r, str(exc)) from None
    per_record = [len(x) if isinstance(x, tuple) else 1 for x in rendered]
    flat = [x for group in rendered for x in (group if isinstance(group, tuple) else (group,))]
    flat_sources = [s for s, n in zip(sources, per_record) for _ in range(n)]
    examples = tokenize_rendered(tokenizer, flat, opts.train_on_eos, flat_sources)
    out, at = [], 0
    for rec, n, src in zip(records, per_record, sources):
        out.append(assemble(rec.data, examples[at : at + n], src))
        at += n
    return out


def tool_format_for(tokenizer, opts: RenderOptions, records: list[Record]) -> str:
    """The tool format these records render with: `auto` becomes `template` when the chat
    template renders tool calls (and schemas, if the records have any), else a built-in one;
    data without tool calls keeps `auto`, which renders like `template`."""
    if opts.tool_format != "auto" or not any(uses_tools(r.data) for r in records):
        return opts.tool_format
    return resolve_tool_format(tokenizer, "auto", any(r.data.get("tools") for r in records))


def needs_template(fmt: str, records: list[Record], opts: RenderOptions) -> bool:
    """Chat data, message lists anywhere, or prompts rendered as chat need a template."""
    if fmt in ("text", "reward", "prm"):
        return False
    if fmt == "chat" or opts.chat:
        return True
    keys = ("prompt", "completion", "chosen", "rejected")
    return any(isinstance(r.data.get(k), list) for r in records for k in keys)


def _chat(tok, rec, opts):
    return render_conversation(tok, rec["messages"], trained_flags(rec["messages"], opts), rec.get("tools"),
                               opts.tool_format)


def _instruction(tok, rec, opts):
    chat_prompt, alpaca = instruction_prompt(rec)
    if rec.get("system"):
        opts = replace(opts, system_prompt=rec["system"])
    return render_prompt_response(tok, chat_prompt, rec["output"], opts, raw_prompt=alpaca)


def _completion(tok, rec, opts):
    return render_prompt_response(tok, rec["prompt"], rec["completion"], opts, tools=rec.get("tools"))


def _preference(tok, rec, opts):
    return (render_prompt_response(tok, rec["prompt"], rec["chosen"], opts, tools=rec.get("tools")),
            render_prompt_response(tok, rec["prompt"], rec["rejected"], opts, tools=rec.get("tools")))


def _reward(tok, rec, opts):
    return Rendered(rec["text"], [], add_special_tokens=True, append_eos=True)


def _score_at_end(rec, exs, src):
    ex = exs[0]
    mask = np.zeros(len(ex), dtype=bool)
    mask[-1:] = True
    return LabeledExample(Example(ex.input_ids, mask, src), rec["label"], src)


def _rl_fields(rec: dict) -> dict:
    """Every column, the prompt as written included: GRPO's reward functions receive them all."""
    return dict(rec)


_FORMATS: dict[str, tuple[Callable, Callable]] = {
    "chat": (_chat, lambda rec, exs, src: exs[0]),
    "text": (lambda tok, rec, opts: render_text(rec["text"]), lambda rec, exs, src: exs[0]),
    "instruction": (_instruction, lambda rec, exs, src: exs[0]),
    "completion": (_completion, lambda rec, exs, src: exs[0]),
    "kto": (_completion, lambda rec, exs, src: LabeledExample(exs[0], rec["label"], src)),
    "preference": (_preference, lambda rec, exs, src: PairExample(exs[0], exs[1], src)),
    "reward": (_reward, _score_at_end),
    "rl": (lambda tok, rec, opts: render_prompt_only(tok, rec["prompt"], opts, rec.get("tools")),
           lambda rec, exs, src: PromptExample(exs[0], _rl_fields(rec), src)),
    "prm": (lambda tok, rec, opts: render_steps(rec["prompt"], rec["completions"]),
            lambda rec, exs, src: StepExample(exs[0], np.asarray(rec["labels"], dtype=bool), src)),
}


# --------------------------------------------------------------------------- generation

def generation_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                      tool_format: str = "template") -> tuple[list[int], str]:
    """Prompt ids up to the last assistant turn, rendered as training rendered the conversation, and
    that turn as text (the reference answer): its content, or for a tool call the call as training
    wrote it: a built-in format's text (`tools.to_builtin_format`), or what the template renders."""
    if tool_format in BUILTIN_TOOL_FORMATS:
        messages, _, _ = to_builtin_format(tool_format, messages, [False] * len(messages), tools)
        tools = None
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise ValueError("a conversation with no assistant turn has no reference answer")
    text = render_chat(tokenizer, messages[:last], add_generation_prompt=True, tools=tools)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not messages[last].get("tool_calls"):
        return list(ids), messages[last]["content"]
    # The template writes the call: the reference is what it renders after the prompt, read back as a
    # greedy answer is (special tokens such as the end-of-turn marker dropped).
    whole = render_chat(tokenizer, messages[: last + 1], tools=tools)
    if not whole.startswith(text):
        raise ValueError("the chat template renders the conversation's start differently when the answer "
                         "follows it, so the answer cannot be cut out of it as a reference")
    answer = tokenizer(whole[len(text):], add_special_tokens=False)["input_ids"]
    return list(ids), tokenizer.decode(answer, skip_special_tokens=True).rstrip()