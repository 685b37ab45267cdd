"""Tool calling: schemas and calls rendered by the model's template or a built-in format, calls carrying
loss, tool results never, and nothing the record holds silently dropped."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from mudpuppy.data.formats import normalize_record
from mudpuppy.data.readers import Record
from mudpuppy.data.render import RenderOptions
from mudpuppy.data.report import mark_loss_tokens
from mudpuppy.data.templates import BUILTIN_TEMPLATES
from mudpuppy.data.tokenize import tokenize_records
from mudpuppy.data.tools import resolve_tool_format
from mudpuppy.errors import DataError

from .published_templates import LLAMA31, QWEN25

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]}}}
ARGS = {"city": "Paris", "unit": "celsius"}


def call(name="get_weather", args=None, as_string=False):
    args = ARGS if args is None else args
    return {"id": "call_1", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args) if as_string else args}}


def conversation(calls=None, content=None, tools=(WEATHER,)):
    record = {"messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": content, "tool_calls": calls or [call(as_string=True)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
        {"role": "assistant", "content": "It is 18 degrees and sunny in Paris."}]}
    if tools:
        record["tools"] = list(tools)
    return record


def tokenize(tok, *records, template=None, **opts):
    if template is not None:
        tok.chat_template = template
    recs = [Record(normalize_record("chat", r), i + 3, i + 3) for i, r in enumerate(records)]
    return tokenize_records(tok, "chat", recs, RenderOptions(**opts), "tools.jsonl")


def trained_text(tok, ex) -> list[str]:
    """The decoded runs of loss-carrying tokens."""
    marked = mark_loss_tokens(tok, ex)
    return re.findall(r"\[\[(.*?)\]\]", marked, re.S)


CHATML = BUILTIN_TEMPLATES["chatml"].jinja
LLAMA3 = BUILTIN_TEMPLATES["llama3"].jinja


# --------------------------------------------------------------------------- the model's own template

def test_qwen_template_renders_the_call_inside_loss_carrying_tokens(tok):
    ex = tokenize(tok, conversation(), template=QWEN25)[0]
    runs = trained_text(tok, ex)
    assert runs[0] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                       "</tool_call><|im_end|>")
    assert runs[1] == "It is 18 degrees and sunny in Paris.<|im_end|>"
    marked = mark_loss_tokens(tok, ex)
    assert '"name": "get_weather", "description"' in marked.split("[[")[0]     # the schema, in the system turn
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in marked
    assert "18 degrees, sunny" not in "".join(runs)


def test_llama31_template_renders_the_call_inside_loss_carrying_tokens(tok):
    runs = trained_text(tok, tokenize(tok, conversation(), template=LLAMA31)[0])
    assert runs[0] == '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}<|eot_id|>'


def test_arguments_as_a_dict_or_a_json_string_render_alike(tok):
    as_dict = tokenize(tok, conversation([call()]), template=QWEN25)[0]
    as_text = tokenize(tok, conversation([call(as_string=True)]), template=QWEN25)[0]
    assert np.array_equal(as_dict.input_ids, as_text.input_ids)
    assert np.array_equal(as_dict.loss_mask, as_text.loss_mask)


def test_auto_uses_the_template_when_it_renders_tools_else_a_builtin(tok):
    for template, expected in ((QWEN25, "template"), (LLAMA31, "template"), (CHATML, "hermes"), (LLAMA3, "llama3")):
        tok.chat_template = template
        assert resolve_tool_format(tok, "auto", with_schemas=True) == expected, template[:40]


# --------------------------------------------------------------------------- built-in formats

@pytest.mark.parametrize("fmt,template,expected", [
    ("hermes", CHATML, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                       "</tool_call><|im_end|>"),
    ("llama3", CHATML, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}<|im_end|>'),
    ("hermes", LLAMA3, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                       "</tool_call><|eot_id|>"),
    ("llama3", LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}<|eot_id|>'),
])
def test_builtin_formats_render_the_call_inside_loss_carrying_tokens(tok, fmt, template, expected):
    ex = tokenize(tok, conversation(), template=template, tool_format=fmt)[0]
    runs = trained_text(tok, ex)
    assert runs[0] == expected
    assert len(runs) == 2 and "18 degrees, sunny" not in "".join(runs)
    assert '"name": "get_weather"' in mark_loss_tokens(tok, ex).split("[[")[0]     # the schema, before any call


def test_hermes_round_trip_of_parallel_calls(tok):
    calls = [call(args={"city": "Paris"}, as_string=True), call("get_time", {"zone": "Europe/Paris"})]
    ex = tokenize(tok, conversation(calls, content="Checking both."), template=CHATML, tool_format="hermes")[0]
    first = trained_text(tok, ex)[0]
    assert first.startswith("Checking both.\n<tool_call>")
    parsed = [json.loads(m) for m in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", first, re.S)]
    assert parsed == [{"name": "get_weather", "arguments": {"city": "Paris"}},
                      {"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]


@pytest.mark.parametrize("template,marker", [(LLAMA3, "<|eot_id|>"), (LLAMA31, "<|eot_id|>")])
def test_llama3_round_trip(tok, template, marker):
    fmt = "llama3" if template == LLAMA3 else "auto"
    ex = tokenize(tok, conversation([call(as_string=True)]), template=template, tool_format=fmt)[0]
    first = trained_text(tok, ex)[0]
    assert first.endswith(marker)
    parsed = json.loads(first[: -len(marker)])
    assert parsed == {"name": "get_weather", "parameters": ARGS}


# --------------------------------------------------------------------------- what never carries loss

def test_tool_results_never_carry_loss_even_with_train_on_inputs(tok):
    ex = tokenize(tok, conversation(), template=CHATML, tool_format="hermes", train_on_inputs=True)[0]
    runs = "".join(trained_text(tok, ex))
    assert "What is the weather" in runs and "18 degrees, sunny" not in runs


def test_a_tool_result_marked_train_is_refused():
    record = conversation()
    record["messages"][2]["train"] = True
    with pytest.raises(ValueError, match=r"messages\[2\].train is true on a tool result"):
        normalize_record("chat", record)


def test_roles_to_train_with_tool_is_refused_before_loading(make_cfg, write):
    from mudpuppy.data import load_data

    path = write("t.jsonl", [conversation()])
    with pytest.raises(DataError, match="tool results never carry loss"):
        load_data(make_cfg([{"path": str(path), "roles_to_train": ["assistant", "tool"]}]))


# --------------------------------------------------------------------------- nothing vanishes

def test_a_template_that_drops_tool_calls_is_an_error_at_the_record(tok):
    # The tiny tokenizer's ChatML template writes role and content only: the call would vanish.
    with pytest.raises(DataError) as err:
        tokenize(tok, conversation(), tool_format="template")
    assert str(err.value).startswith("tools.jsonl:3: messages[1] (assistant):")
    assert "'get_weather' would vanish" in str(err.value) and "tool_format: hermes or llama3" in str(err.value)


def test_text_beside_a_call_that_the_template_drops_is_an_error(tok):
    with pytest.raises(DataError, match=r"tools.jsonl:3: messages\[1\] \(assistant\): the chat template leaves"):
        tokenize(tok, conversation(content="Let me look that up."), template=LLAMA31)


def test_llama3_format_refuses_what_it_cannot_write(tok):
    two = [call(as_string=True), call("get_time", {})]
    with pytest.raises(DataError, match=r"tools.jsonl:3: messages\[1\] makes 2 tool calls in one turn"):
        tokenize(tok, conversation(two), template=CHATML, tool_format="llama3")
    with pytest.raises(DataError, match="has both text and a tool call"):
        tokenize(tok, conversation(content="Looking."), template=CHATML, tool_format="llama3")


def test_a_template_that_drops_a_message_is_an_error(tok):
    no_system = ("{% for m in messages %}{% if m['role'] != 'system' %}{{ '<|im_start|>' + m['role'] + '\n'"
                 " + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    record = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "hello"}]}
    with pytest.raises(DataError, match=r"tools.jsonl:3: messages\[0\] \(system\): the chat template leaves"):
        tokenize(tok, record, template=no_system)


@pytest.mark.parametrize("bad,expected", [
    ({"function": {"arguments": {}}}, r"tool_calls\[0\] must be"),
    (call(args=None) | {"function": {"name": "f", "arguments": "{city: Paris}"}}, "arguments is a string but not JSON"),
    ({"function": {"name": "f", "arguments": [1, 2]}}, "arguments must be an object"),
])
def test_malformed_calls_say_what_was_found(bad, expected):
    with pytest.raises(ValueError, match=expected):
        normalize_record("chat", conversation([bad]))


def test_tools_given_as_a_json_string_as_csv_and_parquet_store_them(tok):
    as_text = tokenize(tok, {**conversation(), "tools": json.dumps([WEATHER])}, template=QWEN25)[0]
    as_list = tokenize(tok, conversation(), template=QWEN25)[0]
    assert np.array_equal(as_text.input_ids, as_list.input_ids)


# --------------------------------------------------------------------------- the CLI

def test_preprocess_shows_the_call_in_loss_brackets(tmp_path, tiny_model_dir):
    from mudpuppy.cli import main

    data = tmp_path / "tools.jsonl"
    data.write_text(json.dumps(conversation()) + "\n")
    cfg = {"model": {"base_model": str(tiny_model_dir)},
           "data": {"datasets": [{"path": str(data)}], "sequence_len": 2048, "cache_dir": str(tmp_path / "cache")},
           "output_dir": str(tmp_path / "out")}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(main, ["preprocess", str(tmp_path / "cfg.yaml"), "--samples", "1"])
    assert result.exit_code == 0, result.output
    assert "chat, 1 examples, tool calls written by hermes" in result.output
    assert ('<|im_start|>assistant\n[[<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call><|im_end|>]]') in result.output


# --------------------------------------------------------------------------- held-out generation
@pytest.mark.parametrize("fmt,template,marker", [
    ("hermes", CHATML, "<|im_end|>"), ("llama3", LLAMA3, "<|eot_id|>"), ("template", QWEN25, "<|im_end|>")])
def test_generation_prompt_of_a_tool_call_is_the_prefix_training_saw_and_the_call_its_reference(
        tok, fmt, template, marker):
    """Exact match on tool calls: the prompt renders the tools as training did, and the reference is the
    call as training wrote it (what a greedy answer decodes to), not the empty content beside it."""
    from mudpuppy.data.tokenize import generation_prompt

    record = conversation()
    record["messages"] = record["messages"][:2]                     # the last assistant turn is the call
    ex = tokenize(tok, record, template=template, tool_format=fmt)[0]
    normalized = normalize_record("chat", record)
    prompt_ids, reference = generation_prompt(tok, normalized["messages"], normalized["tools"], fmt)
    assert ex.input_ids[: len(prompt_ids)].tolist() == prompt_ids
    assert not ex.loss_mask[: len(prompt_ids)].any() and ex.loss_mask[len(prompt_ids)]
    [trained] = trained_text(tok, ex)
    assert reference == trained.removesuffix(marker).rstrip() and "get_weather" in reference
    assert "Paris" in reference


def test_held_out_records_carry_their_datasets_tool_format(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from mudpuppy import load_config
    from mudpuppy.data import prepare_data
    from mudpuppy.data.prepare import EVAL_TOOL_FORMAT

    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(conversation()) + "\n" + json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    cfg = load_config({"model": {"base_model": str(tiny_model_dir)}, "output_dir": str(tmp_path / "out"),
                       "data": {"datasets": [{"path": str(path)}],
                                "val_datasets": [{"path": str(path), "tool_format": "hermes"}]}})
    data = prepare_data(cfg, AutoTokenizer.from_pretrained(tiny_model_dir), use_cache=False)
    assert [r.get(EVAL_TOOL_FORMAT) for r in data.val_records] == ["hermes", None]
