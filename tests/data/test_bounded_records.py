"""Bounded records (issue 37): a record larger than data.max_record_bytes, or a key given twice in one JSON
object, is an error naming file:line (or skipped with skip_bad_records); a damaged data-cache entry is
tokenized afresh with one line saying so."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import yaml

from mudpuppy.config import DataConfig
from mudpuppy.data import prepare_sft_data
from mudpuppy.data.sources import read_file
from mudpuppy.errors import DataError

LIMIT = 1000


def chat(i: int, answer: str = "ok") -> dict:
    return {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": answer}]}


def read(path, tolerant=False, limit=LIMIT):
    return read_file(path, path.name, tolerant, limit)


def test_the_default_limit_is_documented_in_the_schema():
    field = DataConfig.model_fields["max_record_bytes"]
    assert field.default == 4 * 2**20 and "file:line" in field.description


# --------------------------------------------------------------------------- size


def test_a_json_line_over_the_limit_names_its_line_before_it_is_parsed(write):
    # Not even JSON: a line over the limit is refused by its length alone.
    path = write("big.jsonl", json.dumps(chat(1)) + "\n" + "{" * 5000 + "\n" + json.dumps(chat(3)) + "\n")
    with pytest.raises(DataError) as info:
        read(path)
    assert info.value.line == 2 and str(info.value).startswith("big.jsonl:2: this line is 5,000 bytes")
    assert "data.max_record_bytes (1,000)" in str(info.value)


def test_an_oversized_record_is_skipped_with_skip_bad_records(write):
    path = write("big.jsonl", [chat(1), chat(2, "x" * 5000), chat(3)])
    source = read(path, tolerant=True)
    assert [r.line for r in source.records] == [1, 3]
    assert [p.line for p in source.problems] == [2] and "max_record_bytes" in source.problems[0].message


def test_the_limit_is_in_bytes_not_characters(write):
    path = write("wide.jsonl", json.dumps(chat(1, "é" * 400), ensure_ascii=False))   # 400 characters, 800 bytes
    assert len(read(path, limit=900).records) == 1
    with pytest.raises(DataError, match="wide.jsonl:1:"):
        read(path, limit=700)


@pytest.mark.parametrize("layout", ["array", "wrapped"])
def test_a_json_array_record_over_the_limit_names_the_line_it_starts_on(write, layout):
    records = ",\n".join(json.dumps(r) for r in [chat(1), chat(2, "x" * 5000), chat(3)])
    body = f"[\n{records}\n]" if layout == "array" else f'{{"source": "me",\n"data": [\n{records}\n]}}'
    path = write("big.json", body)
    with pytest.raises(DataError) as info:
        read(path)
    assert info.value.line == (3 if layout == "array" else 4) and "max_record_bytes" in str(info.value)


def test_csv_and_parquet_rows_over_the_limit_are_refused(write, tmp_path):
    import pandas as pd

    frame = pd.DataFrame({"prompt": ["a", "b" * 5000, "c"], "completion": ["x", "y", "z"]})
    frame.to_csv(tmp_path / "big.csv", index=False)
    frame.to_parquet(tmp_path / "big.parquet")
    with pytest.raises(DataError, match=r"big.csv:3: this record is 5,0\d\d bytes"):
        read(tmp_path / "big.csv")
    with pytest.raises(DataError, match=r"big.parquet: row 2: this record is 5,0\d\d bytes"):
        read(tmp_path / "big.parquet")


# --------------------------------------------------------------------------- duplicate keys


def test_two_messages_keys_in_a_json_line_are_an_error_naming_the_line(write):
    second = '{"messages": [{"role": "user", "content": "a"}], "messages": [{"role": "user", "content": "b"}]}'
    path = write("dup.jsonl", json.dumps(chat(1)) + "\n" + second + "\n")
    with pytest.raises(DataError) as info:
        read(path)
    assert info.value.line == 2 and "the key 'messages' appears twice in one JSON object" in str(info.value)


def test_a_duplicate_key_inside_a_message_is_found_too(write):
    line = '{"messages": [{"role": "user", "content": "a", "content": "b"}]}'
    with pytest.raises(DataError, match=r"dup.jsonl:1: the key 'content' appears twice"):
        read(write("dup.jsonl", line + "\n"))


def test_duplicate_keys_are_skipped_with_skip_bad_records(write):
    text = "\n".join([json.dumps(chat(1)), '{"text": "a", "text": "b"}', json.dumps(chat(3))])
    source = read(write("dup.jsonl", text), tolerant=True)
    assert [r.line for r in source.records] == [1, 3] and [p.line for p in source.problems] == [2]


@pytest.mark.parametrize("layout, line", [("array", 3), ("wrapped", 4)])
def test_a_duplicate_key_in_a_json_array_names_the_record_line(write, layout, line):
    records = ",\n".join([json.dumps({"text": "one"}), '{"text": "a", "text": "b"}', json.dumps({"text": "two"})])
    body = f"[\n{records}\n]" if layout == "array" else f'{{"source": "me",\n"data": [\n{records}\n]}}'
    with pytest.raises(DataError) as info:
        read(write("dup.json", body))
    assert info.value.line == line and "the key 'text' appears twice" in str(info.value)


def test_a_duplicate_key_outside_the_records_is_an_error_too(write):
    body = '{"data": [{"text": "one"}], "data": [{"text": "two"}]}'
    with pytest.raises(DataError, match="dup.json: the key 'data' appears twice"):
        read(write("dup.json", body))


def test_duplicate_columns_in_csv_and_parquet_are_an_error(write, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = write("dup.csv", "prompt,completion,prompt\na,b,c\n")
    with pytest.raises(DataError, match="dup.csv: the column 'prompt' appears twice in the header"):
        read(path)
    table = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"]), pa.array(["c"])],
                                 names=["prompt", "completion", "prompt"])
    pq.write_table(table, tmp_path / "dup.parquet")
    with pytest.raises(DataError, match="dup.parquet: .*prompt"):    # pyarrow's own refusal, or ours
        read(tmp_path / "dup.parquet")


def test_a_bad_value_is_echoed_cut_short(write, tmp_path):
    from mudpuppy.data.prepare import load_data
    from mudpuppy.configure import load_config

    def message(record) -> str:
        path = write("bad.jsonl", [record])
        cfg = load_config({"model": {"base_model": str(tmp_path)}, "data": {"datasets": [{"path": str(path)}]},
                           "output_dir": str(tmp_path / "out")}, check_files=False)
        with pytest.raises(DataError) as info:
            load_data(cfg)
        return str(info.value)

    role = message({"messages": [{"role": "w" * 1_000_000, "content": "hi"}]})
    assert "bad.jsonl:1: messages[0].role 'www" in role and len(role) < 300, role[:500]
    fields = message({f"field{i:05d}" * 20: i for i in range(10_000)})
    assert "no known format" in fields and "9988 more" in fields and len(fields) < 2000, fields[:2500]


# --------------------------------------------------------------------------- through the CLI


def cli(*args, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "mudpuppy", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_a_200_mb_line_is_refused_in_seconds_and_little_memory(tiny_config, tmp_path):
    """The issue's case: a 200 MB single line took 17 GB. Refused by its length: peak RSS of the whole
    command (Python, imports, the file's bytes) measured from a wrapper whose only child it is."""
    data = tmp_path / "big.jsonl"
    with data.open("w") as fh:
        fh.write(json.dumps(chat(1)) + "\n" + '{"text": "')
        for _ in range(200):
            fh.write("x" * 2**20)
        fh.write('"}\n')
    tiny_config["data"]["datasets"] = [{"path": str(data)}]
    tiny_config["data"]["val_datasets"] = []
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config))
    wrapper = ("import resource, subprocess, sys, time; t = time.monotonic(); "
               "d = subprocess.run([sys.executable, '-m', 'mudpuppy', 'preprocess', sys.argv[1]], capture_output=True, "
               "text=True); print(d.returncode, round(time.monotonic() - t, 1), "
               "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024); print(d.stdout + d.stderr)")
    done = subprocess.run([sys.executable, "-c", wrapper, str(cfg)], capture_output=True, text=True, timeout=300)
    code, seconds, peak_mb = done.stdout.split("\n", 1)[0].split()
    assert int(code) == 2, done.stdout
    assert "big.jsonl:2: this line is 209,715," in done.stdout and "Traceback" not in done.stdout
    assert float(seconds) < 60 and int(peak_mb) < 1024, done.stdout


def test_preprocess_names_a_duplicate_key_and_a_configured_limit(tiny_config, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(chat(1)) + "\n" + '{"messages": [], "messages": []}\n')
    tiny_config["data"].update(datasets=[{"path": str(data)}], val_datasets=[])
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config))
    done = cli("preprocess", cfg)
    out = done.stdout + done.stderr
    assert done.returncode == 2 and "d.jsonl:2: the key 'messages' appears twice" in out and "Traceback" not in out
    data.write_text(json.dumps(chat(1)) + "\n" + json.dumps(chat(2, "y" * 300)) + "\n")
    done = cli("preprocess", cfg, "--set", "data.max_record_bytes=200")
    out = done.stdout + done.stderr
    assert done.returncode == 2 and "d.jsonl:2: this line is" in out and "(200)" in out


# --------------------------------------------------------------------------- the data cache


def damage_entry(entry, how: str) -> None:
    """SFT entries are token stores (flat arrays, sha256 in meta.json): cut one, change a byte, or make
    meta.json disagree with the arrays."""
    tokens = entry / "tokens.bin"
    data = tokens.read_bytes()
    if how == "truncated":
        tokens.write_bytes(data[: len(data) // 2])
    elif how == "flipped":                       # one token's bytes changed: its checksum no longer matches
        at = len(data) // 2
        tokens.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:])
    else:                                        # meta.json no longer matches the arrays
        meta = json.loads((entry / "meta.json").read_text())
        meta["store"]["count"] -= 1
        (entry / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("how", ["truncated", "flipped", "meta"])
def test_a_damaged_cache_entry_is_tokenized_afresh_with_one_warning(make_cfg, tok, write, caplog, how):
    cfg = make_cfg([write("d.jsonl", [chat(i) for i in range(40)])])
    written = prepare_sft_data(cfg, tok, write_cache=True)
    # Copies: the written views map the very files the damage rewrites in place.
    expected = [e.input_ids.copy() for e in written.train]
    damage_entry(__import__("pathlib").Path(written.report.cache_path), how)
    with caplog.at_level(logging.WARNING, logger="mudpuppy.data.cache"):
        again = prepare_sft_data(cfg, tok)
    assert again.report.cache == "fresh" and again.report.train_examples == written.report.train_examples
    warnings = [r.getMessage() for r in caplog.records if r.name == "mudpuppy.data.cache"]
    assert len(warnings) == 1 and "is damaged" in warnings[0] and "tokenizing the data afresh" in warnings[0]
    assert len(expected) == len(again.train)
    for a, b in zip(expected, again.train):
        assert (a == b.input_ids).all()


def test_a_run_over_a_truncated_cache_entry_trains_and_says_so_once(tiny_config, tmp_path):
    tiny_config["data"].update(cache_dir=str(tmp_path / "cache"), val_datasets=[])
    tiny_config["training"]["max_steps"] = 1
    tiny_config["eval"] = {"before_training": False, "after_training": False}
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config))
    assert cli("preprocess", cfg, "-n", "0").returncode == 0
    (entry,) = (tmp_path / "cache").iterdir()
    damage_entry(entry, "truncated")
    done = cli("run", "--config", cfg)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert out.count("is damaged") == 1 and "tokens.bin holds" in out and "Traceback" not in out
