"""Every format read record by record (sources.py): the records, lines, fingerprints and messages of the
whole-file readers these replaced, and memory bounded by the largest record, not the file.

EXPECTED holds what the whole-file reader (readers.read_file at e20db33) gave for each file, strict and
with skip_bad_records: the message, or the (line, row) of each record kept and each problem's message.
One precedence differs, by design: a record over the limit and nested too deeply is reported as over
the limit (it is measured, never parsed).
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import json
import subprocess
import sys
import textwrap
import zipfile

import pytest

from mudpuppy.data import load_data, stream
from mudpuppy.data.prepare import load_dataset
from mudpuppy.data.sources import read_file
from mudpuppy.errors import DataError

from .conftest import SAMPLES

LIMIT = 500

EXPECTED = {
    'array_malformed.json': ('[\n  {"text": "a"},\n  {"text": "b" "c": 1}\n]\n',
        "{name}:3: malformed JSON: Expecting ',' delimiter at column 16",
        "{name}:3: malformed JSON: Expecting ',' delimiter at column 16"),
    'array_unclosed.json': ('[\n  {"text": "a"},\n  {"text": "b"}\n',
        "{name}:4: malformed JSON: the array is never closed with ']'",
        "{name}:4: malformed JSON: the array is never closed with ']'"),
    'array_between.json': ('[{"text": "a"} {"text": "b"}]',
        "{name}:1: malformed JSON: expected ',' or ']' between records, found '{'",
        "{name}:1: malformed JSON: expected ',' or ']' between records, found '{'"),
    'array_between_wide.json': ('[{"text": "a"}\n\n  é{"text": "b"}]',
        "{name}:3: malformed JSON: expected ',' or ']' between records, found 'é'",
        "{name}:3: malformed JSON: expected ',' or ']' between records, found 'é'"),
    'array_number.json': ('[{"text": "a"}, 7, {"text": "b"}]',
        '{name}:1: expected a JSON object {...}, found a number',
        [(1, 1), (1, 2), '1: expected a JSON object {...}, found a number']),
    'array_list.json': ('[{"text": "a"},\n [1, 2]]',
        '{name}:2: expected a JSON object {...}, found an array',
        [(1, 1), '2: expected a JSON object {...}, found an array']),
    'array_mismatch.json': ('[\n {"text": ["a"}]\n',
        "{name}:2: malformed JSON: Expecting ',' delimiter at column 15",
        "{name}:2: malformed JSON: Expecting ',' delimiter at column 15"),
    'array_dup.json': ('[\n {"text": "a"},\n {"text": "a", "text": "b"}\n]',
        "{name}:3: the key 'text' appears twice in one JSON object (JSON readers keep only the last, so one of them would be lost); keep one",
        [(2, 1), "3: the key 'text' appears twice in one JSON object (JSON readers keep only the last, so one of them would be lost); keep one"]),
    'array_trailing_comma.json': ('[{"text": "a"},]',
        [(1, 1)],
        [(1, 1)]),
    'array_leading_comma.json': ('[,{"text": "a"}]',
        '{name}:1: malformed JSON: Expecting value at column 2',
        '{name}:1: malformed JSON: Expecting value at column 2'),
    'array_scalar_junk.json': ('[{"text": "a"}, 1x]',
        '{name}:1: expected a JSON object {...}, found a number',
        "{name}:1: malformed JSON: expected ',' or ']' between records, found 'x'"),
    'array_unterminated_string.json': ('[{"text": "a"}, {"text": "b\n',
        '{name}:1: malformed JSON: Invalid control character at at column 28',
        '{name}:1: malformed JSON: Invalid control character at at column 28'),
    'array_badutf8.json': (b'[{"text": "a"},\n {"text": "caf\xe9"}]',
        "{name}:2: not UTF-8 text (byte b'\\xe9' at column 15); re-save the file as UTF-8",
        "{name}:2: not UTF-8 text (byte b'\\xe9' at column 15); re-save the file as UTF-8"),
    'array_badutf8_after.json': (b'[{"text": "a"},\n {"text": "b"]\n"\xe9"',
        "{name}:3: not UTF-8 text (byte b'\\xe9' at column 2); re-save the file as UTF-8",
        "{name}:3: not UTF-8 text (byte b'\\xe9' at column 2); re-save the file as UTF-8"),
    'array_col.json': ('[{"text": "a"}, {"text": "b",\n "x": tru}]',
        '{name}:2: malformed JSON: Expecting value at column 7',
        '{name}:2: malformed JSON: Expecting value at column 7'),
    'array_col2.json': ('  [{"text": "a"}, {"text": "b", "x": tru}]',
        '{name}:1: malformed JSON: Expecting value at column 38',
        '{name}:1: malformed JSON: Expecting value at column 38'),
    'empty.json': ('  \n ',
        '{name}: the file holds no records',
        '{name}: the file holds no records'),
    'empty_array.json': ('[]',
        '{name}: the file holds no records',
        '{name}: the file holds no records'),
    'obj_data.json': ('{"data": [\n {"text": "a"},\n {"text": "b"}]}',
        [(2, 1), (3, 2)],
        [(2, 1), (3, 2)]),
    'obj_rows_meta.json': ('{"meta": {"v": 1}, "rows": [{"text": "a"}], "n": 1}',
        [(1, 1)],
        [(1, 1)]),
    'obj_rows_list_of_lists.json': ('{"meta": 1, "rows": [[1]]}',
        [(1, 1)],
        [(1, 1)]),
    'obj_single.json': ('{"text": "a"}',
        [(1, 1)],
        [(1, 1)]),
    'obj_pretty_single.json': ('{\n "text": "a"\n}',
        '{name}:1: malformed JSON: Expecting property name enclosed in double quotes at column 2',
        '{name}:1: no usable records: all 3 were bad; the first: malformed JSON: Expecting property name enclosed in double quotes at column 2'),
    'obj_dup_top.json': ('{"data": [{"text": "a"}], "data": [{"text": "b"}]}',
        "{name}: the key 'data' appears twice in one JSON object (JSON readers keep only the last, so one of them would be lost); keep one",
        "{name}: the key 'data' appears twice in one JSON object (JSON readers keep only the last, so one of them would be lost); keep one"),
    'obj_dup_in_record.json': ('{"data": [{"text": "a"},\n {"text": "b", "text": "c"}]}',
        "{name}:2: the key 'text' appears twice in one JSON object (JSON readers keep only the last, so one of them would be lost); keep one",
        "{name}: the key 'text' appears twice in one JSON object (JSON readers keep only the last, so one of them would be lost); keep one"),
    'obj_dup_in_meta.json': ('{"meta": {"a": 1, "a": 2}, "data": [{"text": "a"}]}',
        "{name}: the key 'a' appears twice in one JSON object (JSON readers keep only the last, so one of them would be lost); keep one",
        "{name}: the key 'a' appears twice in one JSON object (JSON readers keep only the last, so one of them would be lost); keep one"),
    'obj_malformed_record.json': ('{"data": [{"text": "a"},\n {"text": "b" "x"}]}',
        '{name}:1: malformed JSON: Expecting value at column 25',
        '{name}:1: no usable records: all 2 were bad; the first: malformed JSON: Expecting value at column 25'),
    'obj_split.json': ('{"columns": ["text", "n"], "index": [0, 1], "data": [["a", 1], ["b", null]]}',
        [(None, 1), (None, 2)],
        [(None, 1), (None, 2)]),
    'obj_columns.json': ('{"text": {"0": "a", "1": "b"}, "n": {"0": 1, "1": null}}',
        [(None, 1), (None, 2)],
        [(None, 1), (None, 2)]),
    'obj_lines.json': ('{"text": "a"}\n{"text": "b"}\n',
        [(1, 1), (2, 2)],
        [(1, 1), (2, 2)]),
    'obj_lines_bad.json': ('{"text": "a"}\n{"text": "b"\n',
        "{name}:2: malformed JSON: Expecting ',' delimiter at column 13",
        [(1, 1), "2: malformed JSON: Expecting ',' delimiter at column 13"]),
    'obj_badutf8.json': (b'{"data": [{"text": "a"},\n {"text": "caf\xe9"}]}',
        "{name}:2: not UTF-8 text (byte b'\\xe9' at column 15); re-save the file as UTF-8",
        "{name}:2: not UTF-8 text (byte b'\\xe9' at column 15); re-save the file as UTF-8"),
    'obj_nonrecord_data.json': ('{"data": [1, 2], "x": 3}',
        [(1, 1)],
        [(1, 1)]),
    'obj_oversize.json': ('{"data": [{"text": "a"},\n {"text": "<LONG>"}]}',
        '{name}:2: this record is 712 bytes, over data.max_record_bytes (500); split it into smaller records, or raise data.max_record_bytes if it is meant to be this large',
        [(1, 1), '2: this record is 712 bytes, over data.max_record_bytes (500); split it into smaller records, or raise data.max_record_bytes if it is meant to be this large']),
    'array_oversize.json': ('[{"text": "a"},\n {"text": "<LONG>"}, {"text": "b"}]',
        '{name}:2: this record is 712 bytes, over data.max_record_bytes (500); split it into smaller records, or raise data.max_record_bytes if it is meant to be this large',
        [(1, 1), (2, 2), '2: this record is 712 bytes, over data.max_record_bytes (500); split it into smaller records, or raise data.max_record_bytes if it is meant to be this large']),
    'split_oversize.json': ('{"columns": ["text"], "data": [["a"], ["<LONG>"]]}',
        '{name}: row 2: this record is 704 bytes, over data.max_record_bytes (500); split it into smaller records, or raise data.max_record_bytes if it is meant to be this large',
        [(None, 1), 'split_oversize.json: row 2: this record is 704 bytes, over data.max_record_bytes (500); split it into smaller records, or raise data.max_record_bytes if it is meant to be this large']),
    'bad.csv': ('text,n\na,1\nb,2,3\n',
        '{name}: malformed CSV: Error tokenizing data. C error: Expected 2 fields in line 3, saw 3\n',
        '{name}: malformed CSV: Error tokenizing data. C error: Expected 2 fields in line 3, saw 3\n'),
    'dup.csv': ('text,text\na,1\n',
        "{name}: the column 'text' appears twice in the header; rename or remove one",
        "{name}: the column 'text' appears twice in the header; rename or remove one"),
    'empty.csv': ('',
        '{name}: the file holds no records',
        '{name}: the file holds no records'),
    'types.csv': ('text,n,f,b,m\na,1,1.5,True,1\nb,,2,false,x\n\nc,3,,TRUE,\n',
        [(2, 1), (3, 2), (5, 3)],
        [(2, 1), (3, 2), (5, 3)]),
    'multiline.csv': ('text,n\n"a\nb",1\n\n"c\u2028d",2\ne,3\n',
        [(2, 1), (5, 2), (7, 3)],
        [(2, 1), (5, 2), (7, 3)]),
    'badutf8.csv': (b'text\na\ncaf\xe9\n',
        "{name}:3: not UTF-8 text (byte b'\\xe9' at column 4); re-save the file as UTF-8",
        "{name}:3: not UTF-8 text (byte b'\\xe9' at column 4); re-save the file as UTF-8"),
    'oversize.csv': ('text\na\n<LONG>\nb\n',
        '{name}:3: this record is 704 bytes, over data.max_record_bytes (500); split it into smaller records, or raise data.max_record_bytes if it is meant to be this large',
        [(2, 1), (4, 3), '3: this record is 704 bytes, over data.max_record_bytes (500); split it into smaller records, or raise data.max_record_bytes if it is meant to be this large']),
    'lead_blank.csv': ('\n\ntext\na\nb\n',
        [(3, 1), (4, 2)],
        [(3, 1), (4, 2)]),
}


def outcome(path, name: str, tolerant: bool):
    """What EXPECTED records for one reading: the message, or kept records' (line, row) and problems."""
    try:
        source = read_file(path, name, tolerant, LIMIT)
    except DataError as exc:
        return str(exc).replace(name, "{name}", 1)
    return [(r.line, r.row) for r in source.records] + \
        [p.message if p.line is None else f"{p.line}: {p.message}" for p in source.problems]


def zipped(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(name, data)
    return buf.getvalue()


def variants(name: str, raw: bytes) -> dict[str, bytes]:
    """The file as tools export it: compressed, zipped, Windows-made, UTF-16; each must read the same."""
    out = {name: raw, name + ".gz": gzip.compress(raw), name + ".bz2": bz2.compress(raw),
           name + ".zip": zipped(name, raw), "crlf-" + name: codecs.BOM_UTF8 + raw.replace(b"\n", b"\r\n") + b"\x1a"}
    try:
        out["utf16-" + name] = raw.decode("utf-8").replace("\n", "\r\n").encode("utf-16")
    except UnicodeDecodeError:
        pass
    try:
        import zstandard
        out[name + ".zst"] = zstandard.ZstdCompressor().compress(raw)
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_records_lines_and_messages_are_the_whole_file_readers(write, case):
    content, strict, tolerant = EXPECTED[case]
    raw = content if isinstance(content, bytes) else content.replace("<LONG>", "y" * 700).encode("utf-8")
    for name, data in variants(case, raw).items():
        path = write(name, data)
        assert outcome(path, case, False) == strict, name
        assert outcome(path, case, True) == tolerant, name


# --------------------------------------------------------------------------- the test data, in every layout

def sample_records(name: str) -> list[dict]:
    return [json.loads(line) for line in (SAMPLES / name).read_text().splitlines() if line.strip()]


SAMPLE_NAMES = sorted(p.name for p in SAMPLES.glob("sample_*.jsonl"))


def layouts(records: list[dict]) -> dict[str, tuple[bytes, list[int | None]]]:
    """JSON layouts of `records`, each with the line (or None) every record should carry."""
    lines = "".join(("," if i else "") + "\n" + json.dumps(r, ensure_ascii=False) for i, r in enumerate(records))
    n = len(records)
    return {
        "array.json": (("[" + lines + "\n]\n").encode(), list(range(2, n + 2))),
        "data.json": (('{"version": 2, "data": [' + lines + "\n]}").encode(), list(range(2, n + 2))),
        "one-line.json": (json.dumps({"rows": records}).encode(), [1] * n),
        "lines.json": ("".join(json.dumps(r) + "\n" for r in records).encode(), list(range(1, n + 1))),
    }


@pytest.mark.parametrize("sample", SAMPLE_NAMES)
def test_every_sample_reads_alike_in_every_json_layout_and_compression(write, sample):
    records = sample_records(sample)
    for layout, (raw, lines) in layouts(records).items():
        for name, data in variants(f"{sample}.{layout}", raw).items():
            source = read_file(write(name, data), name)
            assert [r.data for r in source.records] == records, name
            assert [r.line for r in source.records] == lines, name
            assert [r.row for r in source.records] == list(range(1, len(records) + 1)), name


@pytest.mark.parametrize("sample", SAMPLE_NAMES)
def test_every_sample_reads_alike_from_parquet_by_row_group(write, tmp_path, sample, monkeypatch):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    from mudpuppy.data import stream_tables

    records = sample_records(sample)
    try:
        table = pa.Table.from_pylist(records)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        pytest.skip("fields of mixed types: no Parquet schema holds them")
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=3)
    expected = [{k: v for k, v in row.items() if v is not None} for row in table.to_pylist()]
    monkeypatch.setattr(stream_tables, "ROWS", 2)          # batches smaller than a row group
    for name, data in {"a.parquet": buf.getvalue(), "a.parquet.gz": gzip.compress(buf.getvalue()),
                       "a.parquet.zip": zipped("a.parquet", buf.getvalue())}.items():
        source = read_file(write(name, data), name)
        assert [r.data for r in source.records] == expected, name
        assert [r.row for r in source.records] == list(range(1, len(expected) + 1))


def test_csv_types_each_column_over_all_its_chunks_as_one_read_would(write, monkeypatch):
    """Chunk by chunk, a column of 1s then 2.5 would be ints then a float; read whole it is floats."""
    import pandas as pd

    from mudpuppy.data import stream_tables

    text = "prompt,completion,score,flag,mixed\n" + "".join(
        f"p{i},c{i},{1 if i < 5 else 2.5},{'True' if i % 2 else 'false'},{i if i < 7 else 'x'}\n" for i in range(9))
    text += '"a\nquoted, cell",done,,,\n'
    path = write("t.csv", text)
    whole = pd.read_csv(path, keep_default_na=False, na_values=[""], dtype_backend="numpy_nullable")
    whole = [{k: v for k, v in r.items() if v is not None}
             for r in whole.astype(object).where(whole.notna(), None).to_dict("records")]
    monkeypatch.setattr(stream_tables, "ROWS", 2)
    source = read_file(path, "t.csv")
    assert [r.data for r in source.records] == whole
    assert source.records[0].data["score"] == 1.0 and isinstance(source.records[0].data["score"], float)
    assert source.records[0].data["mixed"] == "0" and source.records[1].data["flag"] is True
    assert [r.line for r in source.records] == list(range(2, 11)) + [11]
    assert read_file(path, "t.csv").fingerprint == source.fingerprint


def test_the_sample_csv_reads_as_pandas_reads_it_whole(monkeypatch):
    import pandas as pd

    from mudpuppy.data import stream_tables

    path = SAMPLES / "sample_instruction.csv"
    whole = pd.read_csv(path, keep_default_na=False, na_values=[""], dtype_backend="numpy_nullable")
    whole = [{k: v for k, v in r.items() if v is not None}
             for r in whole.astype(object).where(whole.notna(), None).to_dict("records")]
    monkeypatch.setattr(stream_tables, "ROWS", 1)
    assert [r.data for r in read_file(path, path.name).records] == whole


def test_a_one_line_array_is_counted_once_for_its_columns(write, monkeypatch):
    """Records' columns (for messages) are counted on from the last one: json.dumps(records) without indent,
    one long line, costs one pass, not one per record (which made a 2.7 MB line take seconds)."""
    from mudpuppy.data import json_window

    counted = []
    real = json_window.chars
    monkeypatch.setattr(json_window, "chars", lambda text: counted.append(len(text)) or real(text))
    records = sample_records("sample_sharegpt.jsonl") * 400
    raw = json.dumps(records, ensure_ascii=False).encode()
    source = read_file(write("one-line.json", raw), "one-line.json")
    assert [r.data for r in source.records] == records and {r.line for r in source.records} == {1}
    assert sum(counted) <= 2 * len(raw)


# --------------------------------------------------------------------------- SFT: scanned, then read again

def test_sft_streams_every_format_to_the_records_read_whole(make_cfg, write, tmp_path, monkeypatch):
    """With KEEP 0 every file is scanned and read again in chunks: the same records, lines and format as
    the whole read keeps; and the same skipped records, tolerated."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(stream, "KEEP", 0)
    records = sample_records("sample_instruction.jsonl")
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "i.parquet", row_group_size=2)
    files = [write("i.json", json.dumps(records, indent=1)),
             write("i.json.gz", gzip.compress(json.dumps({"data": records}).encode())),
             write("i.csv", pd.DataFrame(records).to_csv(index=False)), tmp_path / "i.parquet",
             write("bad.json", json.dumps(records + [{"instruction": 3}], indent=1))]
    for path in files:
        for tolerant in (False, True):
            cfg = make_cfg([path], skip_bad_records=tolerant)
            spec = cfg.data.datasets[0]
            try:
                whole = load_dataset(cfg, spec)
            except DataError as exc:
                with pytest.raises(DataError) as err:
                    load_dataset(cfg, spec, stream=True)
                assert str(err.value) == str(exc)
                continue
            streamed = load_dataset(cfg, spec, stream=True)
            assert streamed.stream is not None and not streamed.records
            flat = [(r.row, r.line, r.data) for chunk in streamed.chunks(3) for r in chunk]
            assert flat == [(r.row, r.line, r.data) for r in whole.records], path.name
            assert (streamed.format, streamed.skipped, streamed.fingerprint) == \
                (whole.format, whole.skipped, whole.fingerprint), path.name


def test_sft_streams_zstd_json_lines_even_misnamed(make_cfg, write, monkeypatch):
    """zstd is not split by stream.lines(): a .jsonl holding zstd (known by its first bytes) goes to sources.py."""
    zstandard = pytest.importorskip("zstandard")
    monkeypatch.setattr(stream, "KEEP", 0)
    text = (SAMPLES / "sample_sharegpt.jsonl").read_bytes()
    cfg = make_cfg([write("misnamed.jsonl", zstandard.ZstdCompressor().compress(text))])
    streamed, whole = load_dataset(cfg, cfg.data.datasets[0], stream=True), load_dataset(cfg, cfg.data.datasets[0])
    assert [(r.line, r.data) for chunk in streamed.chunks(2) for r in chunk] == \
        [(r.line, r.data) for r in whole.records]


# --------------------------------------------------------------------------- hub datasets

@pytest.fixture()
def hub_dir(tmp_path):
    """A dataset as the hub serves one, saved locally: a folder of data files `datasets` loads offline."""
    folder = tmp_path / "hub-dataset"
    folder.mkdir()
    rows = sample_records("sample_sharegpt.jsonl")
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, rows


@pytest.mark.parametrize("streaming", [False, True])
def test_a_hub_dataset_is_read_row_by_row(hub_dir, streaming, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from mudpuppy.data.stream_hub import hub_records

    folder, rows = hub_dir
    got = list(hub_records(str(folder), "train", None, streaming, False, LIMIT))
    assert [r.data for r in got] == rows and [r.row for r in got] == list(range(1, len(rows) + 1))
    with pytest.raises(DataError, match="row 1: this record is .* bytes, over data.max_record_bytes"):
        list(hub_records(str(folder), "train", None, streaming, False, 20))


def test_streaming_true_in_the_config_reads_an_iterable_dataset(hub_dir, make_cfg, monkeypatch):
    """The config's hub name reaches datasets.load_dataset with streaming=True; pointed here at the local
    folder (no network), the records, format and fingerprint follow, and a second read agrees."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder, rows = hub_dir
    calls = []
    real = datasets.load_dataset

    def local(name, subset=None, **kwargs):
        calls.append((name, subset, kwargs))
        return real(str(folder), subset, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", local)
    monkeypatch.setattr(stream, "KEEP", 0)
    cfg = make_cfg([{"path": "someone/chats", "streaming": True}])
    loaded = load_data(cfg, "sft")
    ds = loaded.train[0]
    assert calls and all(c[0] == "someone/chats" and c[2] == {"split": "train", "streaming": True} for c in calls)
    assert ds.format == "chat" and ds.record_count() == len(rows)
    assert [r.line for chunk in ds.chunks(2) for r in chunk] == [None] * len(rows)
    assert load_data(cfg, "sft").fingerprints() == loaded.fingerprints()
    monkeypatch.setattr(stream, "KEEP", 10**9)
    assert [r.data for r in load_data(cfg, "sft").train[0].records] == [r.data for chunk in ds.chunks(2) for r in chunk]
    assert "streaming" not in make_cfg([{"path": "someone/chats"}]).data.model_dump()["datasets"][0]


# --------------------------------------------------------------------------- memory

CHILD = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    from mudpuppy.data.sources import file_records
    from mudpuppy.errors import DataError
    count, error = 0, None
    try:
        for item in file_records(Path(sys.argv[1]), "big", sys.argv[2] == "tolerant", 4 << 20):
            count += 1
    except DataError as exc:
        error = str(exc)
    # VmHWM: this process's own peak; ru_maxrss would also count the test process it was forked from
    status = Path("/proc/self/status")
    hwm = [line.split()[1] for line in status.read_text().splitlines() if line.startswith("VmHWM")] \
        if status.exists() else []
    peak_kb = int(hwm[0]) if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"count": count, "error": error, "peak_mb": peak_kb / 1024}))
""")


def read_in_child(path, mode: str = "strict") -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def write_array(path, megabytes: int) -> int:
    """A JSON array of chats `megabytes` large, written a record at a time; the number of records."""
    chat = {"messages": [{"role": "user", "content": "turn the kitchen light on " * 3},
                         {"role": "assistant", "content": "lights_on, and the timer is set for ten minutes " * 8}]}
    line = json.dumps(chat)
    count = megabytes * 2**20 // (len(line) + 2)
    with open(path, "w") as f:
        f.write("[\n")
        for i in range(count):
            f.write(("," if i else "") + "\n" + line)
        f.write("\n]\n")
    return count


@pytest.mark.slow
def test_a_200_mb_json_array_is_read_in_the_memory_of_a_2_mb_one(tmp_path):
    small, large = tmp_path / "small.json", tmp_path / "large.json"
    counts = write_array(small, 2), write_array(large, 200)
    first, second = read_in_child(small), read_in_child(large)
    assert (first["count"], second["count"]) == counts and first["error"] is None is second["error"]
    assert second["peak_mb"] - first["peak_mb"] < 30, (first, second)


def test_a_20_mb_json_array_is_read_in_the_memory_of_a_2_mb_one(tmp_path):
    small, large = tmp_path / "small.json.gz", tmp_path / "large.json"
    write_array(tmp_path / "small.json", 2)
    small.write_bytes(gzip.compress((tmp_path / "small.json").read_bytes()))
    counts = write_array(tmp_path / "small.json", 2), write_array(large, 20)
    first, second = read_in_child(small), read_in_child(large)
    assert (first["count"], second["count"]) == counts
    assert second["peak_mb"] - first["peak_mb"] < 15, (first, second)


@pytest.mark.parametrize("name", ["one.json", "one.jsonl.zst"])
def test_a_200_mb_record_is_refused_with_its_line_in_little_memory(tmp_path, name):
    """The record is measured as it streams past, never held: a clear limit message, and tolerated, the
    records around it."""
    path = tmp_path / name
    body = "y" * (1 << 20)
    if name.endswith(".zst"):
        zstandard = pytest.importorskip("zstandard")
        with open(path, "wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as f:
            f.write(b'{"text": "a"}\n{"text": "')
            for _ in range(200):
                f.write(body.encode())
            f.write(b'"}\n{"text": "b"}\n')
        size = 200 * len(body) + len('{"text": ""}')
    else:
        with open(path, "w") as f:
            f.write('[{"text": "a"},\n {"text": "')
            for _ in range(200):
                f.write(body)
            f.write('"},\n {"text": "b"}]\n')
        size = 200 * len(body) + len('{"text": ""}')
    strict, tolerant = read_in_child(path), read_in_child(path, "tolerant")
    what = "line" if name.endswith(".zst") else "record"
    assert strict["error"] == (f"big:2: this {what} is {size:,} bytes, over data.max_record_bytes (4,194,304); split "
                               "it into smaller records, or raise data.max_record_bytes if it is meant to be this large")
    assert tolerant["count"] == 3 and tolerant["error"] is None
    assert strict["peak_mb"] < 150 and tolerant["peak_mb"] < 150, (strict, tolerant)
