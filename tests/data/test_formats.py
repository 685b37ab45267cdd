"""Format detection, field mapping, record validation and the method/format table."""

from __future__ import annotations

import pytest

from mudpuppy.data.formats import (
    FORMATS, METHOD_FORMATS, check_method_format, detect_format, normalize_record, normalize_records, rename_fields,
)
from mudpuppy.data.readers import RawSource, Record
from mudpuppy.errors import DataError

from .conftest import SAMPLES

SAMPLE_FILES = {
    "chat": "smart_home_train.jsonl", "text": "sample_text.jsonl", "instruction": "sample_instruction.jsonl",
    "completion": "sample_completion.jsonl", "preference": "sample_preference.jsonl", "kto": "sample_kto.jsonl",
    "reward": "sample_reward.jsonl", "rl": "sample_rl.jsonl", "prm": "sample_prm.jsonl",
}


def source(*records, name="d.jsonl") -> RawSource:
    return RawSource(name, [Record(r, i + 1, i + 1) for i, r in enumerate(records)], "fp")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_is_detected_from_its_example_record(fmt):
    assert detect_format(source(FORMATS[fmt].example)) == fmt


@pytest.mark.parametrize("fmt,filename", list(SAMPLE_FILES.items()))
def test_each_sample_file_is_detected_and_valid(fmt, filename):
    from mudpuppy.data.sources import read_file

    raw = read_file(SAMPLES / filename, filename)
    assert detect_format(raw) == fmt
    assert len(normalize_records(raw, fmt, tolerant=False)) == len(raw.records)


def test_every_format_is_documented_in_a_method_or_accepted_somewhere():
    accepted = {f for formats in METHOD_FORMATS.values() for f in formats}
    assert accepted == set(FORMATS)


@pytest.mark.parametrize("record", [
    {"instruction": "Do it", "response": "done"},
    {"input": "Do it", "output": "done"},
    {"instruction": "Do it", "input": "now", "output": "done"},
])
def test_instruction_variants(record):
    assert detect_format(source(record)) == "instruction"
    out = normalize_record("instruction", record)
    assert out["output"] == "done" and out["instruction"] == "Do it"


def test_detection_uses_all_records_not_the_first():
    # The first record alone looks like completion data; the file is KTO with one record lacking its label.
    recs = [{"prompt": "a", "completion": "b"}] + [{"prompt": "a", "completion": "b", "label": True}] * 3
    with pytest.raises(DataError) as err:
        detect_format(source(*recs))
    msg = str(err.value)
    assert "mixes formats" in msg and "kto (3 records, first at line 2)" in msg
    assert "completion (1 records, first at line 1; missing 'label' for kto?)" in msg


def test_mixed_formats_are_an_error():
    with pytest.raises(DataError, match=r"mixes formats: chat .* text"):
        detect_format(source({"messages": [{"role": "user", "content": "x"}]},
                             {"messages": [{"role": "user", "content": "y"}]}, {"text": "z"}))


def test_mixed_formats_tolerated_keep_the_majority():
    raw = source({"text": "a"}, {"text": "b"}, {"prompt": "p", "completion": "c"})
    assert detect_format(raw, tolerant=True) == "text"
    assert len(normalize_records(raw, "text", tolerant=True)) == 2
    assert raw.problems[0].line == 3 and "missing field 'text'" in raw.problems[0].message


def test_a_record_matching_nothing_names_what_was_expected():
    with pytest.raises(DataError) as err:
        detect_format(source({"question": "q", "answer": "a"}))
    assert err.value.line == 1
    assert "found fields ['answer', 'question']" in err.value.detail and "field_map" in err.value.detail


def test_a_record_missing_a_field_names_its_line():
    raw = source({"text": "a"}, {"txt": "b"}, {"text": "c"})
    fmt = detect_format(raw)
    with pytest.raises(DataError) as err:
        normalize_records(raw, fmt, tolerant=False)
    assert err.value.line == 2
    assert "missing field 'text' for text format" in err.value.detail and "found fields ['txt']" in err.value.detail


def test_declared_type_checks_every_record():
    raw = source({"prompt": "a", "completion": "b"}, {"prompt": "c"})
    assert detect_format(raw, "completion") == "completion"
    with pytest.raises(DataError, match=r"d.jsonl:2: missing field 'completion' for completion format"):
        normalize_records(raw, "completion", tolerant=False)


@pytest.mark.parametrize("fmt,record,expected", [
    ("text", {"text": 5}, "field 'text' must be a string, found int 5"),
    ("kto", {"prompt": "p", "completion": "c", "label": "yes"}, "field 'label' must be true or false, found str 'yes'"),
    ("reward", {"text": "t", "label": True}, "field 'label' must be a number"),
    ("reward", {"text": "t", "label": "high"}, "field 'label' must be a number"),
    ("chat", {"messages": "hello"}, "field 'messages' must be a non-empty list"),
    ("chat", {"messages": []}, "field 'messages' must be a non-empty list"),
    ("chat", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content must be a string, found int 3"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role 'wizard' is not one of"),
    ("chat", {"messages": [{"role": "user", "content": "x", "train": "no"}]}, "messages[0].train must be true or false"),
    ("chat", {"messages": ["hi"]}, "messages[0] must be an object"),
    ("preference", {"prompt": "p", "chosen": 1, "rejected": "r"}, "field 'chosen' must be a string or a list of messages"),
    ("instruction", {"instruction": "i", "output": None}, "must be a string, found nothing"),
    ("prm", {"prompt": "p", "completions": ["a", "b"], "labels": [True]}, "'labels' has 1 entries but 'completions' has 2"),
    ("prm", {"prompt": "p", "completions": [], "labels": []}, "field 'completions' must be a non-empty list"),
    ("prm", {"prompt": "p", "completions": ["a"], "labels": [1]}, "field 'labels' must be a list of true/false"),
])
def test_wrong_types_say_what_was_expected_and_found(fmt, record, expected):
    with pytest.raises(ValueError) as err:
        normalize_record(fmt, record)
    assert expected in str(err.value)


def test_wrong_type_error_names_file_and_line():
    with pytest.raises(DataError) as err:
        normalize_records(source({"text": "ok"}, {"text": ["not", "a", "string"]}), "text", tolerant=False)
    assert (err.value.file, err.value.line) == ("d.jsonl", 2)
    assert "must be a string, found list" in err.value.detail


def test_rows_without_lines_are_named_by_row():
    raw = RawSource("t.parquet", [Record({"text": "a"}, 1), Record({"text": 2}, 2)], "fp")
    with pytest.raises(DataError, match=r"^t.parquet: row 2: field 'text' must be a string"):
        normalize_records(raw, "text", tolerant=False)


def test_field_map_renames_fields_and_message_keys():
    record = {"conversation": [{"speaker": "user", "text": "hi"}], "id": 1}
    mapped = rename_fields(record, {"conversation": "messages", "speaker": "role", "text": "content"})
    assert detect_format(source(mapped)) == "chat"
    assert normalize_record("chat", mapped)["messages"] == [{"role": "user", "content": "hi"}]


def test_field_map_for_prompt_response_data():
    mapped = rename_fields({"question": "2+2?", "answer": "4"}, {"question": "prompt", "answer": "completion"})
    assert detect_format(source(mapped)) == "completion"


def test_sharegpt_conversations_become_messages():
    record = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                                {"from": "gpt", "value": "a"}]}
    out = normalize_record("chat", record)
    assert out["messages"] == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                               {"role": "assistant", "content": "a"}]
    assert "conversations" not in out


def test_message_lists_in_preference_data_are_normalized():
    rec = {"prompt": [{"role": "user", "content": "q"}], "chosen": [{"from": "gpt", "value": "a"}], "rejected": "b"}
    out = normalize_record("preference", rec)
    assert out["chosen"] == [{"role": "assistant", "content": "a"}] and out["rejected"] == "b"


def test_method_format_table():
    assert METHOD_FORMATS["sft"] == ("chat", "text", "instruction", "completion")
    for m in ("dpo", "ipo", "simpo", "orpo"):
        assert METHOD_FORMATS[m] == ("preference",)
    assert METHOD_FORMATS["kto"] == ("kto",) and METHOD_FORMATS["grpo"] == ("rl",)
    assert METHOD_FORMATS["rm"] == ("reward", "preference") and METHOD_FORMATS["prm"] == ("prm",)


def test_method_mismatch_names_method_format_and_fields():
    check_method_format("dpo", "preference", "p.jsonl")
    with pytest.raises(DataError) as err:
        check_method_format("dpo", "chat", "c.jsonl")
    msg = str(err.value)
    assert msg.startswith("c.jsonl: method 'dpo' cannot train on 'chat' data")
    assert "{'messages'}" in msg and "preference {'prompt', 'chosen', 'rejected'}" in msg
    with pytest.raises(DataError, match="unknown method 'xyz'"):
        check_method_format("xyz", "chat", "c.jsonl")
