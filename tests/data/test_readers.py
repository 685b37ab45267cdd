"""Reading files: every problem is a DataError naming the file and the line (or row)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mudpuppy.data.sources import read_file, read_source
from mudpuppy.errors import DataError


def read(path, tolerant=False):
    return read_file(path, path.name, tolerant)


def test_jsonl_records_keep_their_line_numbers(write):
    path = write("a.jsonl", '{"text": "one"}\n\n   \n{"text": "two"}\n')
    source = read(path)
    assert [(r.line, r.row, r.data["text"]) for r in source.records] == [(1, 1, "one"), (4, 2, "two")]


def test_malformed_json_names_file_and_line(write):
    path = write("bad.jsonl", '{"text": "ok"}\n{"text": "missing quote}\n')
    with pytest.raises(DataError) as err:
        read(path)
    assert err.value.file == "bad.jsonl" and err.value.line == 2
    assert "malformed JSON" in str(err.value) and str(err.value).startswith("bad.jsonl:2:")


def test_a_line_that_is_not_an_object_is_an_error(write):
    with pytest.raises(DataError, match=r"x.jsonl:2: expected a JSON object \{...\}, found an array"):
        read(write("x.jsonl", '{"text": "a"}\n["text"]\n'))


def test_non_utf8_bytes_name_the_line_and_the_byte(write):
    path = write("latin.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError) as err:
        read(path)
    assert err.value.line == 2 and "not UTF-8" in err.value.detail and "\\xe9" in err.value.detail


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_an_empty_file_is_an_error(write, content):
    with pytest.raises(DataError, match="holds no records"):
        read(write("empty.jsonl", content))


def test_a_missing_file_is_an_error(tmp_path):
    with pytest.raises(DataError, match="file not found") as err:
        read_source(tmp_path / "nope.jsonl", "nope.jsonl")
    assert err.value.file == "nope.jsonl"


def test_an_unsupported_suffix_is_an_error(write):
    with pytest.raises(DataError, match="unsupported file type '.txt'"):
        read(write("notes.txt", "hello"))


def test_json_array_records_carry_the_line_they_start_on(write):
    path = write("a.json", '[\n  {"text": "one"},\n\n  {"text":\n     "two"}\n]\n')
    assert [r.line for r in read(path).records] == [2, 4]


def test_json_object_holding_one_array(write):
    path = write("a.json", '{"data": [\n {"text": "one"},\n {"text": "two"}\n]}')
    assert [r.data["text"] for r in read(path).records] == ["one", "two"]


def test_json_lines_saved_as_json(write):
    path = write("a.json", '{"text": "one"}\n{"text": "two"}\n')
    assert [r.line for r in read(path).records] == [1, 2]


def test_malformed_json_array_names_the_line(write):
    with pytest.raises(DataError) as err:
        read(write("a.json", '[\n {"text": "one"},\n {"text": two}\n]'))
    assert err.value.line == 3 and "malformed JSON" in err.value.detail


def test_unclosed_json_array(write):
    with pytest.raises(DataError, match="never closed"):
        read(write("a.json", '[\n {"text": "one"},\n'))


def test_csv_types_missing_cells_and_lines(write):
    path = write("a.csv", 'text,label,flag\nhello,0.5,true\nNA,,false\n"two\nlines",1,true\nlast,2,false\n')
    records = read(path).records
    assert records[0].data == {"text": "hello", "label": 0.5, "flag": True}
    assert records[1].data == {"text": "NA", "flag": False}          # "NA" stays text; the empty cell is absent
    assert [r.line for r in records] == [2, 3, 4, 6]                   # a quoted cell spans lines 4-5


def test_tsv(write):
    records = read(write("a.tsv", "prompt\tcompletion\nhi\t there\n")).records
    assert records[0].data == {"prompt": "hi", "completion": " there"}


def test_csv_with_non_utf8_bytes(write):
    with pytest.raises(DataError) as err:
        read(write("a.csv", b"text\nok\nbad \xff byte\n"))
    assert err.value.line == 3


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "a.parquet"
    table = pa.table({"messages": [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]],
                      "extra": [None]})
    pq.write_table(table, path)
    record = read(path).records[0]
    assert record.line is None and record.row == 1 and record.where() == "row 1"
    assert record.data == {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def test_a_broken_parquet_file(write):
    with pytest.raises(DataError, match="not a readable Parquet file"):
        read(write("a.parquet", b"PAR1 not really"))


def test_tolerant_reading_collects_problems(write):
    path = write("a.jsonl", '{"text": "ok"}\n{bad\n{"text": "ok"}\n')
    source = read(path, tolerant=True)
    assert len(source.records) == 2
    assert [(p.line, p.message.split(":")[0]) for p in source.problems] == [(2, "malformed JSON")]


def test_tolerant_reading_with_nothing_usable_still_fails(write):
    with pytest.raises(DataError, match="no usable records: all 2 were bad"):
        read(write("a.jsonl", "{bad\n[1]\n"), tolerant=True)


def test_a_name_that_is_no_file_is_tried_as_a_hub_dataset(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="loading it as a hub dataset failed") as err:
        read_source(Path("nobody/no-such-dataset"), "nobody/no-such-dataset")
    assert err.value.file == "nobody/no-such-dataset"
