"""Preference pairs (kind "pair"), KTO and reward examples (kind "labeled") in the memory-mapped token store: the
same tokens, masks, labels, splits, weights, screening, items and reports as the in-memory lists
(`prepare.tokenize_all`) gave, streamed files included."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mudpuppy.data import BUILTIN_TEMPLATES, Batcher, load_data, prepare_data
from mudpuppy.data import pipeline, prepare
from mudpuppy.data.pairs import ItemView, collate_items, drop_screened, kto_items, pair_items, scored_items, \
    screen_records, with_reference
from mudpuppy.data.prepare import tokenize_all
from mudpuppy.data.store import StoreView
from mudpuppy.data.templates import apply_chat_template_choice
from mudpuppy.errors import DataError

from .conftest import SAMPLES

# Every preference file among the samples: plain strings, chat prompts with string answers, chat answers.
PAIR_FILES = ["sample_preference.jsonl", "smart_home_pref_train.jsonl", "topic_comfort_train.jsonl",
              "topic_errands_train.jsonl", "topic_security_train.jsonl", "topic_security_val.jsonl"]
OPTIONS = [{}, {"train_on_eos": "none"}, {"prompt_style": "raw"}]
REPORT = ("per_dataset", "formats", "tool_formats", "truncated", "dropped", "dropped_too_long", "dropped_no_target",
          "skipped", "skipped_at", "train_examples", "val_examples", "loss_token_share", "mix")


def in_memory(cfg, tok, method="dpo"):
    """Today's lists, exactly as prepare_data made them before the store: records read whole, then listed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prepare, "STREAMED", ("sft",))
        loaded = load_data(cfg, method)
    template = apply_chat_template_choice(tok, cfg.data.chat_template)
    return loaded, tokenize_all(cfg, tok, loaded, template is not None)


def both_paths(cfg, tokenizer_dir, method: str):
    """(lists, store) for `method`, each with a fresh tokenizer; None where both refuse the data with the same
    message (a long template that leaves no room for the answer)."""
    from transformers import AutoTokenizer

    loaded = load_data(cfg, method)
    assert loaded.train[0].stream is None or method in ("dpo", "kto", "prm")
    try:
        old = in_memory(cfg, AutoTokenizer.from_pretrained(str(tokenizer_dir)), method)[1]
    except DataError as exc:
        with pytest.raises(DataError) as new_error:
            prepare_data(cfg, AutoTokenizer.from_pretrained(str(tokenizer_dir)), loaded, method=method, use_cache=False)
        assert str(new_error.value) == str(exc)
        return None
    return old, prepare_data(cfg, AutoTokenizer.from_pretrained(str(tokenizer_dir)), loaded, method=method,
                             use_cache=False)


def same_pairs(old, new) -> None:
    """Pairs, or labeled examples (KTO, reward): sequences, sources, labels, lengths, records and report."""
    assert isinstance(new.train, StoreView) and isinstance(old.train, list)
    assert (len(old.train), len(old.val)) == (len(new.train), len(new.val))
    for a, b in zip([*old.train, *old.val], [*new.train, *new.val]):
        assert a.source == b.source and type(a) is type(b)
        assert getattr(a, "label", None) == getattr(b, "label", None) and float(getattr(a, "label", 0)) == float(
            getattr(b, "label", 0))
        if hasattr(a, "step_labels"):
            assert a.step_labels.dtype == b.step_labels.dtype and np.array_equal(a.step_labels, b.step_labels)
        for x, y in zip(a.sequences(), b.sequences()):
            assert x.source == y.source and x.input_ids.dtype == y.input_ids.dtype, a.source
            assert np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.loss_mask, y.loss_mask), a.source
    assert np.array_equal(new.train.lengths, [len(p) for p in old.train])
    assert new.val_records == old.val_records
    assert {k: getattr(new.report, k) for k in REPORT} == {k: getattr(old.report, k) for k in REPORT}


def big_file(write, copies=4):
    """Over stream.KEEP records, so the file is scanned and read again, not kept: every sample pair, repeated,
    one identical pair and one empty answer among them."""
    rows = [json.loads(line) for name in PAIR_FILES for line in (SAMPLES / name).read_text().splitlines()]
    rows = rows * copies
    rows[700] = {"prompt": "p", "chosen": "same", "rejected": "same"}
    rows[1300] = {"prompt": "p", "chosen": " ", "rejected": "no"}
    return write("big_pairs.jsonl", rows)


@pytest.mark.parametrize("template", [None, *BUILTIN_TEMPLATES])
@pytest.mark.parametrize("options", range(len(OPTIONS)))
def test_the_pair_store_holds_exactly_the_tokens_and_masks_of_the_lists(make_cfg, tokenizer_dir, template, options,
                                                                        monkeypatch):
    monkeypatch.setattr(pipeline, "CHUNK", 7)          # several chunks per file
    cfg = make_cfg([{"path": str(SAMPLES / name), **OPTIONS[options]} for name in PAIR_FILES],
                   chat_template=template, sequence_len=70, val_set_size=30, num_proc=1)
    found = both_paths(cfg, tokenizer_dir, "dpo")
    if found is not None:
        assert found[0].report.truncated > 0
        same_pairs(*found)


@pytest.mark.parametrize("method", ["dpo", "rm"])
def test_a_streamed_file_in_two_workers_with_weights_and_a_validation_file(make_cfg, tok, tokenizer_dir, write,
                                                                           method, monkeypatch):
    """A file over KEEP records is scanned and read again (dpo) or held (rm); two workers, chunks of 5, a
    weight, a validation file and dropped pairs: the lists' pairs, and the lists' screening."""
    from transformers import AutoTokenizer

    monkeypatch.setattr(pipeline, "CHUNK", 5)
    big = big_file(write)
    specs = [{"path": str(big), "weight": 0.5}, {"path": str(SAMPLES / "sample_preference.jsonl"), "weight": 2}]
    cfg = make_cfg(specs, val=[SAMPLES / "smart_home_pref_val.jsonl"], num_proc=2, truncation="drop",
                   sequence_len=80)
    loaded = load_data(cfg, method)
    assert (loaded.train[0].stream is not None) == (method == "dpo")
    old_loaded, old = in_memory(cfg, tok, method)
    new = prepare_data(cfg, AutoTokenizer.from_pretrained(str(tokenizer_dir)), loaded, method=method, use_cache=False)
    same_pairs(old, new)
    assert new.report.dropped_too_long > 0 and len(new.val_records) == len(new.val) > 0
    old_screen, new_screen = screen_records(old_loaded.train + old_loaded.val), screen_records(loaded.train, 2)
    assert new_screen.bad == old_screen.bad and len(new_screen.bad) == 2
    kept_old, kept_new = drop_screened(old.train, old_screen), drop_screened(new.train, new_screen)
    assert isinstance(kept_new, StoreView) and len(kept_new) < len(new.train)
    assert [p.source for p in kept_old] == [p.source for p in kept_new]


def test_items_batches_and_reference_from_the_store_match_the_lists(make_cfg, tok, write):
    cfg = make_cfg([big_file(write, copies=2)], val_set_size=10)
    loaded = load_data(cfg, "dpo")
    new = prepare_data(cfg, tok, loaded, method="dpo", use_cache=False)
    old = in_memory(cfg, tok)[1]
    items_new, items_old = pair_items(new.train), pair_items(old.train)
    assert isinstance(items_new, ItemView)
    ref = np.random.default_rng(0).normal(size=(len(items_new), 2)).astype(np.float32)
    items_new, items_old = with_reference(items_new, ref), with_reference(items_old, ref)
    a = Batcher(items_old, 3, 0, seed=5, group_by_length=True, collate_fn=collate_items)
    b = Batcher(items_new, 3, 0, seed=5, group_by_length=True, collate_fn=collate_items)
    for _ in range(a.batches_per_epoch + 2):
        x, y = a.next_batch(), b.next_batch()
        assert np.array_equal(x.batch.input_ids, y.batch.input_ids) and np.array_equal(x.batch.labels, y.batch.labels)
        assert np.array_equal(x.ref_logps, y.ref_logps) and np.array_equal(x.labels, y.labels)
    part = items_new[4:9]
    assert isinstance(part, ItemView) and np.array_equal(part.ref, ref[4:9]) and part[0].source == items_old[4].source


def test_a_cached_pair_store_reads_back_the_same_pairs(make_cfg, tok, write):
    cfg = make_cfg([big_file(write, copies=2)], val_set_size=12)
    written = prepare_data(cfg, tok, method="dpo", write_cache=True)
    reused = prepare_data(cfg, tok, method="dpo")
    assert (written.report.cache, reused.report.cache) == ("written", "reused")
    assert isinstance(reused.train, StoreView) and reused.train.store.kind == "pair"
    assert np.array_equal(written.train.index, reused.train.index)
    for a, b in zip(written.train, reused.train):
        assert a.source == b.source and np.array_equal(a.rejected.input_ids, b.rejected.input_ids)
    assert reused.val_records == written.val_records and reused.report.loss_token_share == written.report.loss_token_share


def test_two_ranks_map_the_one_pair_store_rank_0_wrote(make_cfg, tokenizer_dir, write, tmp_path):
    from transformers import AutoTokenizer

    from .test_shared import run_ranks

    cfg = make_cfg([big_file(write, copies=2)], val_set_size=10)
    loaded = load_data(cfg, "dpo")
    results = run_ranks(2, lambda ranks: prepare_data(cfg, AutoTokenizer.from_pretrained(str(tokenizer_dir)), loaded,
                                                      method="dpo", use_cache=False, ranks=ranks))
    zero, one = results
    assert not isinstance(zero, Exception) and not isinstance(one, Exception), results
    maps = [r.train.store.arrays["tokens"] for r in results]
    assert all(isinstance(m, np.memmap) for m in maps) and maps[0].filename == maps[1].filename
    assert one.train.store.kind == "pair" and one.report.mapped_by == 2   # (tokenized_by counts processes)
    assert list((tmp_path / "cache" / ".scratch").iterdir()) == []           # removed once both mapped
    for a, b in zip(zero.train, one.train):
        assert a.source == b.source and np.array_equal(a.chosen.input_ids, b.chosen.input_ids)


LABELED = {"kto": ["sample_kto.jsonl", "smart_home_kto_train.jsonl", "smart_home_kto_val.jsonl"],
           "rm": ["sample_reward.jsonl", "smart_home_reward_train.jsonl", "smart_home_reward_val.jsonl"]}


@pytest.mark.parametrize("template", [None, *BUILTIN_TEMPLATES])
@pytest.mark.parametrize("method", ["kto", "rm"])
def test_kto_and_reward_examples_in_the_store_are_the_lists_and_so_are_their_items(make_cfg, tokenizer_dir, write,
                                                                                  template, method, monkeypatch):
    """KTO records (a file over KEEP, so streamed) and {text, label} reward records: the lists' examples and
    labels; KTO's items (each with the previous example's completion) and reward items the lists' too."""
    monkeypatch.setattr(pipeline, "CHUNK", 7)
    rows = [json.loads(line) for name in LABELED[method] for line in (SAMPLES / name).read_text().splitlines()]
    rows[1]["label"] = 0.1 if method == "rm" else rows[1]["label"]         # a score float32 would not keep
    specs = [{"path": str(write("data.jsonl", rows * (2 if method == "kto" else 1)))}]
    cfg = make_cfg(specs, chat_template=template, sequence_len=72, val_set_size=25, num_proc=2)
    assert (load_data(cfg, method).train[0].stream is not None) == (method == "kto")
    found = both_paths(cfg, tokenizer_dir, method)
    if found is None:
        return
    old, new = found
    assert new.train.store.kind == "labeled" and (new.report.truncated > 0 or method == "rm")
    same_pairs(old, new)
    make = (lambda xs: kto_items(xs, 60)) if method == "kto" else scored_items
    for split in ("train", "val"):
        a, b = make(getattr(old, split)), make(getattr(new, split))
        assert isinstance(b, ItemView) and np.array_equal(b.lengths, [len(it) for it in a])
        for x, y in zip([*a, *a[3:9]], [*b, *b[3:9]]):
            assert (x.label, x.source, len(x.sequences)) == (y.label, y.source, len(y.sequences))
            for s, t in zip(x.sequences, y.sequences):
                assert np.array_equal(s.input_ids, t.input_ids) and np.array_equal(s.loss_mask, t.loss_mask)


def test_prm_examples_in_the_store_are_the_lists_with_their_step_labels(make_cfg, tokenizer_dir, write, monkeypatch):
    """PRM records (a file over KEEP, streamed; steps cut by truncation): the lists' examples, step labels and
    batches."""
    from mudpuppy.data.pairs import collate_steps

    monkeypatch.setattr(pipeline, "CHUNK", 7)
    rows = [json.loads(line) for name in ("sample_prm.jsonl", "arithmetic_prm_train.jsonl",
                                          "arithmetic_prm_val.jsonl") for line in (SAMPLES / name).read_text().splitlines()]
    cfg = make_cfg([{"path": str(write("prm.jsonl", rows * 4))}], sequence_len=30, val_set_size=40, num_proc=2)
    old, new = both_paths(cfg, tokenizer_dir, "prm")
    assert new.train.store.kind == "steps" and new.report.truncated > 0
    same_pairs(old, new)
    a = Batcher(old.train, 4, 0, seed=2, collate_fn=collate_steps)
    b = Batcher(new.train, 4, 0, seed=2, collate_fn=collate_steps)
    for _ in range(a.batches_per_epoch + 1):
        x, y = a.next_batch(), b.next_batch()
        assert np.array_equal(x.batch.labels, y.batch.labels) and np.array_equal(x.labels, y.labels)


@pytest.mark.parametrize("sequence_len", [72, 512])
def test_kto_item_lengths_come_from_the_store_without_building_an_item(make_cfg, tokenizer_dir, sequence_len,
                                                                       monkeypatch):
    """KTO's items are as long as the longer of the example and its mismatched sequence (its prompt, the
    previous example's completion, cut at sequence_len): the lengths are the store's arrays, equal to
    measuring every built item (the old way), on the views training uses (split, screened, sliced)."""
    from transformers import AutoTokenizer

    from mudpuppy.data import store

    monkeypatch.setattr(store, "PROMPT_BLOCK", 7)       # the mask read in many blocks
    specs = [{"path": str(SAMPLES / name)} for name in LABELED["kto"]]
    cfg = make_cfg(specs, sequence_len=sequence_len, val_set_size=25, num_proc=1)
    loaded = load_data(cfg, "kto")
    data = prepare_data(cfg, AutoTokenizer.from_pretrained(str(tokenizer_dir)), loaded, method="kto", use_cache=False)
    screened = drop_screened(data.train, screen_records(loaded.train))
    cut = sequence_len - 24          # items cut shorter than the store's sequences: the mismatched one is cut
    for view, limit in [(data.train, sequence_len), (data.val, sequence_len), (screened, sequence_len),
                        (data.train, cut)]:
        items = kto_items(view, limit)
        measured = np.fromiter((len(items[i]) for i in range(len(items))), dtype=np.int64, count=len(items))
        assert len(set(measured.tolist())) > 3
        items.build = None           # building an item would fail now: the lengths must not need one
        assert np.array_equal(items.lengths, measured)
        part = kto_items(view, limit)[5:40]
        assert np.array_equal(part.lengths, measured[5:40])
    mismatched = [len(kto_items(data.train, sequence_len)[i].sequences[1]) for i in range(len(data.train))]
    assert max(mismatched) == sequence_len or sequence_len == 512
