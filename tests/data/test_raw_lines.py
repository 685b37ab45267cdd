"""A streamed JSON-lines file's second pass: the parent reads raw lines, the worker parses them.

The records a worker parses from `RawLines` are those pass two yields (data,
line, and row where no line was bad), with field maps, num_samples and
tolerated bad lines; the parent parses nothing while tokenizing.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from mudpuppy.data import load_data, pipeline, prepare_sft_data, readers, stream
from mudpuppy.data.prepare import tokenize_all
from mudpuppy.errors import DataError


def chat(i, role="assistant"):
    return json.dumps({"conversation": [{"role": "user", "content": f"q {i}"}, {"role": role, "content": f"a {i}"}]})


def streamed(make_cfg, path, monkeypatch, **data):
    monkeypatch.setattr(stream, "KEEP", 0)
    monkeypatch.setattr(stream, "DETECT", 3)
    spec = {"path": str(path), "field_map": {"conversation": "messages"}, **data.pop("spec", {})}
    cfg = make_cfg([spec], **data)
    return cfg, load_data(cfg, "sft")


def from_raw(ds, size):
    jobs = list(ds.jobs(size))
    assert all(isinstance(job, stream.RawLines) for job in jobs)
    return [(r.row, r.line, r.data) for job in jobs for r in job.records()]


@pytest.mark.parametrize("size", [1, 4, 100])
def test_raw_chunks_parse_to_the_records_of_pass_two(make_cfg, write, monkeypatch, size):
    lines = [chat(i) for i in range(9)]
    lines[3:3] = ["", "   "]                          # blank lines hold no record
    cfg, loaded = streamed(make_cfg, write("d.jsonl", "\n".join(lines) + "\n"), monkeypatch, spec={"num_samples": 7})
    ds = loaded.train[0]
    assert from_raw(ds, size) == [(r.row, r.line, r.data) for chunk in ds.chunks(size) for r in chunk]
    assert [line for _, line, _ in from_raw(ds, size)] == [1, 2, 3, 6, 7, 8, 9]


def test_tolerated_bad_lines_are_left_out_where_the_worker_parses(make_cfg, write, monkeypatch):
    text = "\n".join([chat(0), chat(1), "{broken", chat(2, role="wizard"), chat(3), "x" * 900, chat(4)])
    _, loaded = streamed(make_cfg, write("d.jsonl", text), monkeypatch, skip_bad_records=True, max_record_bytes=500)
    ds = loaded.train[0]
    assert [line for _, line, _ in from_raw(ds, 2)] == [1, 2, 5, 7]
    assert ds.skipped_count() == 3


def test_a_line_changed_since_the_scan_is_named_by_the_worker(make_cfg, write, monkeypatch):
    path = write("d.jsonl", "\n".join(chat(i) for i in range(6)) + "\n")
    _, loaded = streamed(make_cfg, path, monkeypatch)
    path.write_text("\n".join([chat(0), chat(1), chat(2, role="wizard"), chat(3)]) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl:3: .*wizard"):
        [job.records() for job in loaded.train[0].jobs(2)]


def test_without_the_scans_last_line_num_samples_counts_parsed_records(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(chat(i) for i in range(10)))

    class Spec:
        field_map, num_samples = {"conversation": "messages"}, 4

    chunks = list(stream.reread(path, "d.jsonl", Spec, "chat", False, 10_000).line_chunks(3))
    assert [[r.line for r in chunk] for chunk in chunks] == [[1, 2, 3], [4]]


def test_the_parent_parses_no_line_while_workers_tokenize(make_cfg, tok, tokenizer_dir, write, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setattr(pipeline, "CHUNK", 8)
    path = write("d.jsonl", "\n".join(chat(i) for i in range(60)) + "\n")
    cfg, loaded = streamed(make_cfg, path, monkeypatch, num_proc=2, val_set_size=0.1)
    parsed = []
    real = readers.parse_json_line
    # Counted in this process only: the forked workers' calls land in their own copies of the list.
    monkeypatch.setattr(stream, "parse_json_line", lambda *a: parsed.append(a[2]) or real(*a))
    new = prepare_sft_data(cfg, AutoTokenizer.from_pretrained(str(tokenizer_dir)), loaded, use_cache=False)
    assert parsed == []
    monkeypatch.setattr(stream, "KEEP", 10**9)
    old = tokenize_all(cfg, tok, load_data(cfg, "sft"), True)
    assert len(new.train) == len(old.train) and new.val_records == old.val_records
    for a, b in zip([*old.train, *old.val], [*new.train, *new.val]):
        assert a.source == b.source and np.array_equal(a.input_ids, b.input_ids)
        assert np.array_equal(a.loss_mask, b.loss_mask)


def test_a_streamed_file_without_lines_goes_to_the_workers_as_records(make_cfg, tok, tokenizer_dir, write,
                                                                      monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setattr(pipeline, "CHUNK", 4)
    rows = "".join(f"q {i},a {i}\n" for i in range(30))
    path = write("d.csv", "prompt,completion\n" + rows)
    monkeypatch.setattr(stream, "KEEP", 0)
    cfg = make_cfg([{"path": str(path), "num_samples": 21}], num_proc=2)
    loaded = load_data(cfg, "sft")
    assert loaded.train[0].stream is not None
    jobs = list(loaded.train[0].jobs(4))
    assert all(isinstance(job, list) for job in jobs) and sum(map(len, jobs)) == 21
    new = prepare_sft_data(cfg, AutoTokenizer.from_pretrained(str(tokenizer_dir)), loaded, use_cache=False)
    monkeypatch.setattr(stream, "KEEP", 10**9)
    old = tokenize_all(cfg, tok, load_data(cfg, "sft"), True)
    assert [e.source for e in new.train] == [e.source for e in old.train]
    assert all(np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
               for a, b in zip(old.train, new.train))
