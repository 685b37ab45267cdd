"""Config to prepared data: splits, weights, limits, bad records, templates, the cache."""

from __future__ import annotations

import numpy as np
import pytest

from mudpuppy.data import (
    Example, LabeledExample, PairExample, PromptExample, StepExample, load_data, prepare_data, prepare_sft_data,
)
from mudpuppy.errors import DataError

from .conftest import SAMPLES

TRAIN, VAL = SAMPLES / "smart_home_train.jsonl", SAMPLES / "smart_home_val.jsonl"


def chat(i, answer="ok"):
    return {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": answer}]}


def test_quickstart_data(make_cfg, tok):
    cfg = make_cfg([{"path": str(TRAIN), "num_samples": 40}], val=[{"path": str(VAL), "num_samples": 10}])
    data = prepare_sft_data(cfg, tok)
    rep = data.report
    assert (rep.train_examples, rep.val_examples) == (40, 10) and len(data.val_records) == 10
    assert rep.per_dataset == {str(TRAIN): 40, str(VAL): 10}
    assert rep.formats[str(TRAIN)] == "chat" and 0.05 < rep.loss_token_share < 0.5
    assert all(isinstance(e, Example) and e.has_target() for e in data.train)
    assert data.train[0].source.endswith("smart_home_train.jsonl:1")
    assert rep.cache == "fresh"     # looked for, not found, not written (only preprocess writes)


def test_val_set_size_holds_out_a_seeded_share(make_cfg, tok, write):
    path = write("d.jsonl", [chat(i) for i in range(20)])
    data = prepare_sft_data(make_cfg([path], val_set_size=0.25), tok)
    assert (len(data.train), len(data.val), len(data.val_records)) == (15, 5, 5)
    again = prepare_sft_data(make_cfg([path], val_set_size=0.25), tok)
    assert [e.source for e in data.val] == [e.source for e in again.val]
    assert {e.source for e in data.val}.isdisjoint(e.source for e in data.train)
    assert len(prepare_sft_data(make_cfg([path], val_set_size=3), tok).val) == 3
    with pytest.raises(DataError, match="holds out 20 of 20 examples"):
        prepare_sft_data(make_cfg([path], val_set_size=20), tok)


def test_num_samples_takes_the_first_records(make_cfg, tok, write):
    path = write("d.jsonl", [chat(i) for i in range(10)])
    data = prepare_sft_data(make_cfg([{"path": str(path), "num_samples": 4}]), tok)
    assert [e.source.rsplit(":", 1)[1] for e in data.train] == ["1", "2", "3", "4"]


def test_weights_scale_each_datasets_share(make_cfg, tok, write):
    a = write("a.jsonl", [chat(i, "a") for i in range(10)])
    b = write("b.jsonl", [{"text": f"plain text {i}"} for i in range(10)])
    data = prepare_sft_data(make_cfg([{"path": str(a), "weight": 2}, {"path": str(b), "weight": 0.5}]), tok)
    sources = [e.source.split(":")[0] for e in data.train]
    assert sources.count(str(a)) == 20 and sources.count(str(b)) == 5
    again = prepare_sft_data(make_cfg([{"path": str(a), "weight": 2}, {"path": str(b), "weight": 0.5}]), tok)
    assert [e.source for e in data.train] == [e.source for e in again.train]


def test_truncation_and_drop_policies_are_counted(make_cfg, tok, write):
    long = {"text": "word " * 200}
    no_answer = {"messages": [{"role": "user", "content": "hi"}]}
    path = write("d.jsonl", [long, {"text": "short"}])
    data = prepare_sft_data(make_cfg([path], sequence_len=32), tok)
    assert data.report.truncated == 1 and max(len(e) for e in data.train) == 32
    data = prepare_sft_data(make_cfg([path], sequence_len=32, truncation="drop"), tok)
    assert (data.report.dropped, data.report.dropped_too_long, len(data.train)) == (1, 1, 1)
    chats = write("c.jsonl", [chat(1), no_answer])
    data = prepare_sft_data(make_cfg([chats]), tok)
    assert data.report.dropped_no_target == 1 and len(data.train) == 1


def test_nothing_left_to_train_on_is_an_error(make_cfg, tok, write):
    path = write("d.jsonl", [{"text": "word " * 200}])
    with pytest.raises(DataError, match="no usable training examples after length filtering .1 too long"):
        prepare_sft_data(make_cfg([path], sequence_len=16, truncation="drop"), tok)


def test_datasets_of_different_sft_formats_mix(make_cfg, tok, write):
    paths = [TRAIN, SAMPLES / "sample_text.jsonl", SAMPLES / "sample_instruction.csv",
             SAMPLES / "sample_completion.jsonl", SAMPLES / "sample_sharegpt.jsonl"]
    data = prepare_sft_data(make_cfg([{"path": str(p), "num_samples": 3} for p in paths]), tok)
    assert list(data.report.formats.values()) == ["chat", "text", "instruction", "completion", "chat"]
    assert data.report.train_examples == 14


def test_the_method_is_checked_before_any_tokenizer(make_cfg):
    cfg = make_cfg([SAMPLES / "sample_preference.jsonl"])
    with pytest.raises(DataError) as err:
        load_data(cfg)
    assert "method 'sft' cannot train on 'preference' data" in str(err.value)
    assert str(SAMPLES / "sample_preference.jsonl") in str(err.value) or "sample_preference.jsonl" in err.value.file


def test_a_missing_data_file_names_it(make_cfg, tmp_path):
    with pytest.raises(DataError, match="file not found") as err:
        load_data(make_cfg([tmp_path / "gone.jsonl"]))
    assert "gone.jsonl" in err.value.file


def test_skip_bad_records_reports_count_and_where(make_cfg, tok, write):
    path = write("d.jsonl", "\n".join(['{"text": "a"}', "{broken", '{"text": 3}', '{"txt": "x"}', '{"text": "b"}']))
    with pytest.raises(DataError, match="d.jsonl:2: malformed JSON"):
        load_data(make_cfg([path]))
    data = prepare_sft_data(make_cfg([path], skip_bad_records=True), tok)
    rep = data.report
    assert rep.train_examples == 2 and rep.skipped == 3
    assert [w.split(": ")[0].rsplit(":", 1)[1] for w in rep.skipped_at] == ["2", "3", "4"]
    assert "must be a string" in rep.skipped_at[1] and "missing field 'text'" in rep.skipped_at[2]


def test_field_map_and_declared_type_from_the_config(make_cfg, tok, write):
    path = write("qa.jsonl", [{"question": "2+2?", "answer": "4"}])
    spec = {"path": str(path), "type": "completion", "field_map": {"question": "prompt", "answer": "completion"}}
    data = prepare_sft_data(make_cfg([spec]), tok)
    assert data.report.formats[str(path)] == "completion"
    assert tok.decode(data.train[0].input_ids[data.train[0].loss_mask]) == "4<|im_end|>"
    bad = write("bad.jsonl", [{"prompt": "x"}])
    with pytest.raises(DataError, match=r"bad.jsonl:1: missing field 'completion'"):
        load_data(make_cfg([{"path": str(bad), "type": "completion"}]))


def test_builtin_template_is_installed_on_the_tokenizer(make_cfg, tok, write):
    tok.chat_template = None
    path = write("d.jsonl", [chat(1)])
    with pytest.raises(DataError, match="data.chat_template"):
        prepare_sft_data(make_cfg([path]), tok)
    data = prepare_sft_data(make_cfg([path], chat_template="llama3"), tok)
    assert "<|start_header_id|>" in tok.chat_template
    assert tok.decode(data.train[0].input_ids).count("<|eot_id|>") == 2
    assert any("no single token for <|start_header_id|>" in w for w in data.report.warnings)


def test_prompt_style_and_eval_records(make_cfg, tok, write):
    path = write("i.jsonl", [{"instruction": "Classify", "input": "lights off", "output": "lights_off"}])
    chat_data = prepare_sft_data(make_cfg([path], val=[path]), tok)
    assert chat_data.val_records[0]["messages"][-1] == {"role": "assistant", "content": "lights_off"}
    raw = prepare_sft_data(make_cfg([{"path": str(path), "prompt_style": "raw"}],
                                    val=[{"path": str(path), "prompt_style": "raw"}], sequence_len=512), tok)
    assert "messages" not in raw.val_records[0]
    assert tok.decode(raw.train[0].input_ids).startswith("Below is an instruction")


@pytest.mark.parametrize("method,sample,kind", [
    ("dpo", "sample_preference.jsonl", PairExample), ("rm", "sample_preference.jsonl", PairExample),
    ("kto", "sample_kto.jsonl", LabeledExample), ("rm", "sample_reward.jsonl", LabeledExample),
    ("grpo", "sample_rl.jsonl", PromptExample), ("prm", "sample_prm.jsonl", StepExample),
])
def test_other_methods_get_their_example_types_and_round_trip_the_cache(make_cfg, tok, method, sample, kind):
    cfg = make_cfg([SAMPLES / sample])
    fresh = prepare_data(cfg, tok, method=method, write_cache=True)
    assert fresh.report.cache == "written" and all(isinstance(e, kind) for e in fresh.train)
    cached = prepare_data(cfg, tok, method=method)
    assert cached.report.cache == "reused"
    for a, b in zip(fresh.train, cached.train):
        assert type(a) is type(b) and a.source == b.source
        for sa, sb in zip(a.sequences(), b.sequences()):
            assert np.array_equal(sa.input_ids, sb.input_ids) and np.array_equal(sa.loss_mask, sb.loss_mask)
        if kind is LabeledExample:
            assert a.label == b.label
        if kind is StepExample:
            assert np.array_equal(a.step_labels, b.step_labels)
        if kind is PromptExample:
            assert a.fields == b.fields


def test_cache_is_reused_and_invalidated_by_data_and_tokenizer(make_cfg, tok, write):
    path = write("d.jsonl", [chat(i) for i in range(6)])
    cfg = make_cfg([path], val_set_size=2)
    first = prepare_sft_data(cfg, tok, write_cache=True)
    assert first.report.cache == "written"
    hit = prepare_sft_data(cfg, tok)
    assert hit.report.cache == "reused" and hit.report.cache_path == first.report.cache_path
    assert [e.source for e in hit.train] == [e.source for e in first.train]
    assert hit.val_records == first.val_records and hit.report.train_examples == 4
    # Batching settings do not change tokens: same entry.
    assert prepare_sft_data(make_cfg([path], val_set_size=2, packing=True), tok).report.cache == "reused"
    # A different template (the tokenizer's rendering) or different data: tokenized afresh.
    assert prepare_sft_data(make_cfg([path], val_set_size=2, chat_template="zephyr"), tok).report.cache == "fresh"
    write("d.jsonl", [chat(i) for i in range(7)])
    assert prepare_sft_data(cfg, tok).report.cache == "fresh"
    assert prepare_sft_data(make_cfg([path], val_set_size=2, cache=False), tok).report.cache == "off"


def test_a_corrupt_cache_entry_is_ignored(make_cfg, tok, write):
    path = write("d.jsonl", [chat(i) for i in range(3)])
    cfg = make_cfg([path])
    entry = prepare_sft_data(cfg, tok, write_cache=True).report.cache_path
    (__import__("pathlib").Path(entry) / "meta.json").write_text("{not json")
    assert prepare_sft_data(cfg, tok).report.cache == "fresh"


def test_the_data_layer_imports_neither_torch_nor_mlx():
    import subprocess
    import sys

    code = ("import sys, mudpuppy.data, mudpuppy.data.report, mudpuppy.data.cache; "
            "print(sorted(m for m in ('torch', 'mlx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
