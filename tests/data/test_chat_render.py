"""The conversation renderer's shortcut (the compiled template called directly, each prefix once) against
`apply_chat_template`: the same text for every prefix and probe, and the same tokens and masks from
`tokenize_records`, on every template in the test data (the built-ins, the tokenizer's own, Qwen2.5's
and Llama 3.1's as published) and every SFT chat file, with system prompts, multi-turn chats, tool calls
and results, train_on_inputs, roles and EOS policies."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from mudpuppy.data import BUILTIN_TEMPLATES, load_data
from mudpuppy.data import chat_render
from mudpuppy.data.chat_render import ConversationRenderer, is_plain
from mudpuppy.data.formats import normalize_record
from mudpuppy.data.readers import Record
from mudpuppy.data.render import SENTINEL, RenderOptions, render_chat
from mudpuppy.data.tokenize import tokenize_records

from .conftest import SAMPLES
from .published_templates import LLAMA31, QWEN25

TEMPLATES = {"tokenizer": None, **{k: v.jinja for k, v in BUILTIN_TEMPLATES.items()},
             "qwen2.5": QWEN25, "llama3.1": LLAMA31}
CHAT_FILES = ["smart_home_train.jsonl", "sample_sharegpt.jsonl", "add_sft_train.jsonl", "tickets_train.jsonl",
              "tickets_val.jsonl"]
OPTIONS = [RenderOptions(), RenderOptions(train_on_inputs=True, train_on_eos="last"),
           RenderOptions(roles=frozenset({"assistant", "user"}), train_on_eos="none"),
           RenderOptions(roles=frozenset({"system", "assistant"}), tool_format="hermes")]
PER_FILE = 60     # records per file: every kind of turn they hold is among the first ones
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def tool_records() -> list[Record]:
    """Multi-turn chats with a system prompt, a tool call (arguments as text and as an object) and its result."""
    out = []
    for i, args in enumerate([json.dumps({"city": "Paris"}), {"city": "Oslo"}]):
        messages = [{"role": "system", "content": "You answer about the weather."},
                    {"role": "user", "content": "Weather in town?"},
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"id": "c1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": args}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "18 degrees"},
                    {"role": "assistant", "content": "It is 18 degrees."},
                    {"role": "user", "content": "And tomorrow?"},
                    {"role": "assistant", "content": "Rain, I am afraid."}]
        out.append(Record(normalize_record("chat", {"messages": messages, "tools": [WEATHER]}), i + 1, i + 1))
    return out


def chat_records(make_cfg) -> list[tuple[str, list[Record]]]:
    loaded = load_data(make_cfg([SAMPLES / name for name in CHAT_FILES]), "sft")
    return [(ds.name, [r for chunk in ds.chunks(1000) for r in chunk][:PER_FILE]) for ds in loaded.train]


def tokenized(tok, records: list[Record], opts: RenderOptions, name: str):
    try:
        return tokenize_records(tok, "chat", records, opts, name), None
    except Exception as exc:   # noqa: BLE001 - a DataError, or a template's own refusal: both paths alike
        return None, (type(exc), str(exc))


def counting_direct(monkeypatch) -> list[int]:
    """Counts the renders that take the shortcut, so a test sees it was taken."""
    calls = [0]
    real = chat_render.direct_renderer

    def counted(*args):
        fn = real(*args)
        if fn is None:
            return None

        def render(*a):
            calls[0] += 1
            return fn(*a)
        return render
    monkeypatch.setattr(chat_render, "direct_renderer", counted)
    return calls


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_every_prefix_and_probe_renders_as_apply_chat_template_does(tok, template):
    if TEMPLATES[template] is not None:
        tok.chat_template = TEMPLATES[template]
    for rec in tool_records():
        messages, tools = rec.data["messages"], rec.data["tools"]
        chat = ConversationRenderer(tok, messages, tools)
        assert chat._direct is not None
        for n in range(1, len(messages) + 1):
            for gen in (False, True):
                assert text_or_error(chat.prefix, n, gen) == text_or_error(render_chat, tok, messages[:n], gen, tools)
            probe = {**messages[n - 1], "content": SENTINEL}
            assert text_or_error(chat.probe, n - 1, probe) == \
                text_or_error(render_chat, tok, messages[: n - 1] + [probe], tools=tools)


def text_or_error(fn, *args, **kwargs):
    """The rendered text, or the error (some templates refuse a prefix, e.g. tools with no user turn yet)."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:   # noqa: BLE001 - both paths must fail alike, whatever the error
        return type(exc), str(exc)


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_tokens_and_masks_are_those_of_apply_chat_template(tok, make_cfg, template, monkeypatch):
    if TEMPLATES[template] is not None:
        tok.chat_template = TEMPLATES[template]
    sets = chat_records(make_cfg) + [("tools.jsonl", tool_records())]
    for opts in OPTIONS:
        for name, records in sets:
            with monkeypatch.context() as m:
                m.setattr(chat_render, "direct_renderer", lambda *a: None)   # every render through transformers
                old, old_error = tokenized(tok, records, opts, name)
            with monkeypatch.context() as m:
                calls = counting_direct(m)
                new, new_error = tokenized(tok, records, replace(opts), name)
            assert new_error == old_error, (name, opts)
            assert calls[0] > 0 or old is None
            for a, b in zip(old or (), new or ()):
                assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask), a.source
            assert len(old or ()) == len(new or ())


def test_values_that_transformers_would_rebuild_go_through_it(tok):
    class Text(str):
        pass

    messages = [{"role": "user", "content": Text("hi")}, {"role": "assistant", "content": "hello"}]
    assert not is_plain(messages) and not is_plain((1,)) and not is_plain({1: "a"}) and not is_plain(np.int64(1))
    assert is_plain([{"a": [1, 2.5, True, None, "x"]}])
    chat = ConversationRenderer(tok, messages)
    assert chat._direct is None
    assert chat.prefix(2) == render_chat(tok, messages)
    # A reasoning field is aliased by transformers, and a None value dropped: neither may take the shortcut.
    assert chat_render.direct_renderer(tok, [{"role": "user", "content": "a", "thinking": "b"}], None) is None
    assert chat_render.direct_renderer(tok, [{"role": "user", "content": None}], None) is None


def test_an_empty_conversation_is_refused_in_transformers_words(tok):
    chat = ConversationRenderer(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="empty conversation"):
        chat.prefix(0)


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_remembered_turn_frames_give_the_tokens_and_masks_of_probing_every_turn(tok, make_cfg, template,
                                                                                  monkeypatch):
    if TEMPLATES[template] is not None:
        tok.chat_template = TEMPLATES[template]
    monkeypatch.setattr(chat_render, "_PREPARED", {})     # nothing remembered from other tests
    probes = {"old": 0, "new": 0}
    real_probe = ConversationRenderer.probe
    for opts in OPTIONS:
        for name, records in chat_records(make_cfg) + [("tools.jsonl", tool_records())]:
            out = {}
            for side in ("old", "new"):
                with monkeypatch.context() as m:
                    def counted(self, *args, side=side):
                        probes[side] += 1
                        return real_probe(self, *args)
                    m.setattr(ConversationRenderer, "probe", counted)
                    if side == "old":        # every trained turn probed, as before frames were remembered
                        m.setattr(ConversationRenderer, "frame_key", lambda self, i: None)
                    out[side] = tokenized(tok, records, replace(opts), name)
            (old, old_error), (new, new_error) = out["old"], out["new"]
            assert new_error == old_error, (name, opts)
            assert len(old or ()) == len(new or ())
            for a, b in zip(old or (), new or ()):
                assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask), a.source
    assert probes["new"] < probes["old"] / 2, probes
