"""Streamed JSON lines: the same records, formats, skipped lines and error messages as the whole-file
reader, and the same tokens once in the store, with nothing but the scan's counts kept in memory."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from mudpuppy.data import load_data, prepare_sft_data
from mudpuppy.data import pipeline, stream
from mudpuppy.data.prepare import load_dataset, tokenize_all
from mudpuppy.errors import DataError

from .conftest import SAMPLES


def chat(i, answer="ok"):
    return json.dumps({"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": answer}]})


GOOD = "\n".join(chat(i) for i in range(6)) + "\n"
CASES = {
    "plain": GOOD.encode(),
    "crlf_bom_ctrl_z": b"\xef\xbb\xbf" + GOOD.replace("\n", "\r\n").encode() + b"\x1a",
    "blank_lines": ("\n\n" + GOOD + "\n\n").encode(),
    "malformed": (GOOD + "{broken\n" + chat(9)).encode(),
    "field_then_malformed": (GOOD + '{"messages": [{"role": "wizard", "content": "x"}]}\n{broken\n').encode(),
    "bad_field": (GOOD + '{"messages": [{"role": "wizard", "content": "x"}]}\n').encode(),
    "not_an_object": (GOOD + "[1, 2]\n").encode(),
    "mixed_formats": (GOOD + '{"text": "plain"}\n').encode(),
    "no_format": b'{"question": "a"}\n{"question": "b"}\n',
    "empty": b"\n\n",
    "bad_utf8": (GOOD + '{"text": "caf').encode() + b"\xe9" + b'"}\n',
    "nul": "\n".join(chat(i) for i in range(2)).encode("utf-16-le"),
    "too_long": (GOOD + chat(7, "y" * 600) + "\n" + chat(8)).encode(),
    "duplicate_key": (GOOD + '{"text": "a", "text": "b"}\n').encode(),
    "all_bad": b"{x\n{y\n",
}


def outcome(run):
    try:
        return run(), None
    except DataError as exc:
        return None, str(exc)


def summary(ds):
    records = list(ds.chunks(4)) if ds.stream is not None else [ds.records]
    flat = [(r.row, r.line, r.data) for chunk in records for r in chunk]
    return ds.format, flat, ds.skipped, ds.skipped_count(), ds.record_count()


@pytest.mark.parametrize("tolerant", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("gz", [False, True])
def test_streamed_records_and_errors_are_the_whole_file_readers(make_cfg, tmp_path, monkeypatch, case, tolerant, gz):
    monkeypatch.setattr(stream, "KEEP", 0)         # stream even these small files
    data = CASES[case]
    path = tmp_path / ("d.jsonl.gz" if gz else "d.jsonl")
    path.write_bytes(gzip.compress(data) if gz else data)
    cfg = make_cfg([path], skip_bad_records=tolerant, max_record_bytes=500)
    spec = cfg.data.datasets[0]
    whole, whole_error = outcome(lambda: load_dataset(cfg, spec))
    streamed, streamed_error = outcome(lambda: load_dataset(cfg, spec, stream=True))
    assert streamed_error == whole_error
    if whole is not None:
        assert streamed.stream is not None and not streamed.records
        assert summary(streamed) == summary(whole)


def test_a_damaged_gzip_names_the_file(make_cfg, tmp_path):
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(gzip.compress(GOOD.encode() * 50)[:-30])
    with pytest.raises(DataError, match=r"d.jsonl.gz: not a readable gz file \(.*\); is it complete\?"):
        load_data(make_cfg([path]))


def test_a_line_over_the_limit_is_measured_not_held(make_cfg, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(GOOD + chat(7, "y" * 5_000_000) + "\r\n" + chat(8) + "\n")
    size = len(chat(7, "y" * 5_000_000))           # CRLF counted as the one byte LF the whole-file reader sees
    with pytest.raises(DataError, match=rf"d.jsonl:7: this line is {size:,} bytes, over data.max_record_bytes"):
        load_data(make_cfg([path], max_record_bytes=1000))
    loaded = load_data(make_cfg([path], max_record_bytes=1000, skip_bad_records=True))
    assert loaded.train[0].skipped_count() == 1 and loaded.train[0].record_count() == 7


def test_streamed_sft_data_tokenizes_like_the_lists(make_cfg, tok, tokenizer_dir, monkeypatch, tmp_path):
    """Files past KEEP are read twice (scan, then chunks to the workers); the store holds the same tokens."""
    from transformers import AutoTokenizer

    monkeypatch.setattr(stream, "KEEP", 10)
    monkeypatch.setattr(stream, "DETECT", 10)
    monkeypatch.setattr(pipeline, "CHUNK", 16)
    gz = tmp_path / "smart.jsonl.gz"
    gz.write_bytes(gzip.compress((SAMPLES / "smart_home_train.jsonl").read_bytes()))
    specs = [{"path": str(gz), "num_samples": 200}, {"path": str(SAMPLES / "add_sft_train.jsonl")}]
    cfg = make_cfg(specs, val_set_size=0.1, num_proc=2)
    streamed = load_data(cfg, "sft")
    assert all(ds.stream is not None for ds in streamed.train)
    monkeypatch.setattr(stream, "KEEP", 10**9)
    kept = load_data(cfg, "sft")
    assert all(ds.stream is None for ds in kept.train) and streamed.fingerprints() == kept.fingerprints()
    old = tokenize_all(cfg, tok, kept, True)
    new = prepare_sft_data(cfg, AutoTokenizer.from_pretrained(str(tokenizer_dir)), streamed, use_cache=False)
    assert len(new.train) == len(old.train) and new.val_records == old.val_records
    for a, b in zip([*old.train, *old.val], [*new.train, *new.val]):
        assert a.source == b.source and np.array_equal(a.input_ids, b.input_ids)
        assert np.array_equal(a.loss_mask, b.loss_mask)
    assert new.report.per_dataset == old.report.per_dataset
