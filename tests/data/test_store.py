"""The memory-mapped token store: the same tokens, masks, splits, weights and reports as the list path
(`prepare.tokenize_all`, which other methods still use), in any number of worker processes."""

from __future__ import annotations

import numpy as np
import pytest

from mudpuppy.data import BUILTIN_TEMPLATES, Batcher, load_data, prepare_sft_data
from mudpuppy.data import pipeline
from mudpuppy.data.prepare import tokenize_all
from mudpuppy.data.store import StoreView
from mudpuppy.data.templates import apply_chat_template_choice
from mudpuppy.errors import DataError

from .conftest import SAMPLES

# Every SFT file among the test data: chat (with system turns, tool calls, ShareGPT), text, instruction
# (JSON lines and CSV), completion.
SFT_FILES = ["smart_home_train.jsonl", "sample_sharegpt.jsonl", "add_sft_train.jsonl", "tickets_train.jsonl",
             "sample_text.jsonl", "sample_instruction.jsonl", "sample_instruction.csv", "sample_completion.jsonl",
             "tickets_val.jsonl"]
OPTIONS = [{}, {"train_on_inputs": True, "train_on_eos": "last"}, {"prompt_style": "raw", "train_on_eos": "none"}]


def list_path(cfg, tok, loaded):
    """Today's lists, exactly as prepare_data made them before the store."""
    template = apply_chat_template_choice(tok, cfg.data.chat_template)
    return tokenize_all(cfg, tok, loaded, template is not None)


def same_data(old, new) -> None:
    assert isinstance(new.train, StoreView) and len(old.train) == len(new.train) and len(old.val) == len(new.val)
    for a, b in zip([*old.train, *old.val], [*new.train, *new.val]):
        assert a.source == b.source
        assert a.input_ids.dtype == b.input_ids.dtype and np.array_equal(a.input_ids, b.input_ids), a.source
        assert np.array_equal(a.loss_mask, b.loss_mask), a.source
    assert new.val_records == old.val_records
    keep = ("per_dataset", "formats", "tool_formats", "truncated", "dropped", "dropped_too_long", "dropped_no_target",
            "skipped", "skipped_at", "train_examples", "val_examples", "loss_token_share")
    assert {k: getattr(new.report, k) for k in keep} == {k: getattr(old.report, k) for k in keep}


def outcome(run):
    try:
        return run(), None
    except DataError as exc:
        return None, str(exc)


@pytest.mark.parametrize("template", [None, *BUILTIN_TEMPLATES])
@pytest.mark.parametrize("options", range(len(OPTIONS)))
def test_the_store_holds_exactly_the_tokens_and_masks_of_the_lists(make_cfg, tokenizer_dir, template, options,
                                                                   monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setattr(pipeline, "CHUNK", 7)          # several chunks per file
    specs = [{"path": str(SAMPLES / name), **OPTIONS[options]} for name in SFT_FILES]
    # Short rows: some examples are cut, and the 40 held out are drawn across files.
    cfg = make_cfg(specs, chat_template=template, sequence_len=48, val_set_size=40, num_proc=1)
    loaded = load_data(cfg, "sft")
    old, old_error = outcome(lambda: list_path(cfg, AutoTokenizer.from_pretrained(str(tokenizer_dir)), loaded))
    new, new_error = outcome(lambda: prepare_sft_data(cfg, AutoTokenizer.from_pretrained(str(tokenizer_dir)),
                                                      loaded, use_cache=False))
    assert new_error == old_error
    if old is not None:
        assert old.report.truncated > 0
        same_data(old, new)


@pytest.mark.parametrize("extra", [{"truncation": "drop", "sequence_len": 300},
                                   {"val_datasets": True}, {"weights": True}])
def test_workers_weights_and_validation_files_match_the_lists(make_cfg, tok, tokenizer_dir, write, extra, monkeypatch):
    """Two worker processes, chunks of 5: identical to the one-process lists, including weights, a
    validation file, dropped examples and eval records."""
    from transformers import AutoTokenizer

    monkeypatch.setattr(pipeline, "CHUNK", 5)
    specs = [{"path": str(SAMPLES / "smart_home_train.jsonl"), "num_samples": 60},
             {"path": str(SAMPLES / "add_sft_train.jsonl")}, {"path": str(SAMPLES / "sample_instruction.jsonl")}]
    if extra.get("weights"):
        specs[0]["weight"], specs[1]["weight"] = 0.5, 2
    val = [SAMPLES / "smart_home_val.jsonl"] if extra.get("val_datasets") else None
    data = {k: v for k, v in extra.items() if k not in ("val_datasets", "weights")}
    cfg = make_cfg(specs, val=val, num_proc=2, **({"val_set_size": 0.1} if not val else {}), **data)
    loaded = load_data(cfg, "sft")
    old = list_path(cfg, tok, loaded)
    new = prepare_sft_data(cfg, AutoTokenizer.from_pretrained(str(tokenizer_dir)), loaded, use_cache=False)
    same_data(old, new)
    assert len(new.val_records) == len(new.val) > 0
    assert new.report.dropped_too_long > 0 if "truncation" in extra else new.report.dropped_too_long == 0


def test_an_error_in_a_worker_names_the_first_bad_record(make_cfg, tok, write, monkeypatch):
    """A record the template cannot render fails in a worker; the message is the one-process message, for
    the first such record in file order."""
    monkeypatch.setattr(pipeline, "CHUNK", 3)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                            "tool_calls": [{"name": "f", "arguments": {}}]}]}
    path = write("d.jsonl", [chat] * 10 + [bad] * 3 + [chat] * 10)
    cfg = make_cfg([{"path": str(path), "tool_format": "template"}], num_proc=2)
    loaded = load_data(cfg, "sft")
    with pytest.raises(DataError) as one:
        list_path(cfg, tok, loaded)
    with pytest.raises(DataError) as two:
        prepare_sft_data(cfg, tok, loaded, use_cache=False)
    assert str(two.value) == str(one.value) and ":11:" in str(two.value)


def test_a_cached_store_reads_back_the_same_views(make_cfg, tok, write):
    path = write("d.jsonl", [{"text": f"text number {i} " * (i % 5 + 1)} for i in range(30)])
    cfg = make_cfg([{"path": str(path), "weight": 1.5}], val_set_size=4)
    written = prepare_sft_data(cfg, tok, write_cache=True)
    reused = prepare_sft_data(cfg, tok)
    assert (written.report.cache, reused.report.cache) == ("written", "reused")
    assert np.array_equal(written.train.index, reused.train.index) and np.array_equal(written.val.index, reused.val.index)
    assert [e.source for e in written.train] == [e.source for e in reused.train]
    assert reused.val_records == written.val_records and len(reused.val_records) == 4


def test_an_uncached_store_leaves_nothing_on_disk(make_cfg, tok, write, tmp_path):
    path = write("d.jsonl", [{"text": f"line {i}"} for i in range(10)])
    data = prepare_sft_data(make_cfg([path], cache=False), tok)
    assert data.report.cache == "off" and len(data.train) == 10
    assert not any((tmp_path / "cache" / ".scratch").iterdir())
    assert np.array_equal(data.train[3].input_ids, tok(f"line 3")["input_ids"] + [tok.eos_token_id])


def test_a_batch_costs_the_same_whatever_the_store_size(make_cfg, tok, write):
    """The batcher plans on the lengths array alone and builds a batch from a few slices: the examples it
    materialises for a batch are that batch's, whether the store holds 50 examples or 5,000."""
    calls = {}

    def batch_of(n):
        path = write(f"d{n}.jsonl", [{"text": "word " * (i % 7 + 1)} for i in range(n)])
        data = prepare_sft_data(make_cfg([path], cache=False), tok)
        store, made = data.train.store, []
        original = store.example
        store.example = lambda k: (made.append(k), original(k))[1]
        batcher = Batcher(data.train, 4, 0, seed=1, packing=True, sequence_len=64)
        batcher.next_batch()
        calls[n] = len(made)
        return batcher

    batch_of(50)
    batch_of(5000)
    assert calls[50] <= 64 and calls[5000] <= 64
