"""Files as tools export them: compressed, Windows-made, JSON in the layouts exporters write.
Each variant must read to the same records as the plain file."""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import json
import lzma
import zipfile

import pytest

from mudpuppy.data.readers import is_local
from mudpuppy.data.sources import read_file, read_source
from mudpuppy.errors import DataError

RECORDS = [
    {"messages": [{"role": "user", "content": "Où est la gare ?"}, {"role": "assistant", "content": "À gauche.\nPuis tout droit."}]},
    {"messages": [{"role": "user", "content": "naïve café 中文 🙂"}, {"role": "assistant", "content": "ok"}]},
    {"messages": [{"role": "user", "content": "a \"quoted\" word, and a comma"}, {"role": "assistant", "content": "done"}]},
]
JSONL = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in RECORDS).encode("utf-8")
CSV = 'prompt,completion\n"Où est la gare ?","À gauche.\nPuis tout droit."\nnaïve café,🙂\n"a ""quoted"" word, and a comma",done\n'
CSV_RECORDS = [{"prompt": "Où est la gare ?", "completion": "À gauche.\nPuis tout droit."},
               {"prompt": "naïve café", "completion": "🙂"},
               {"prompt": 'a "quoted" word, and a comma', "completion": "done"}]


def records_of(path):
    return [r.data for r in read_file(path, path.name).records]


def zipped(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(name, data)
    return buf.getvalue()


JSONL_VARIANTS = {
    "a.jsonl.gz": gzip.compress(JSONL),
    "a.jsonl.bz2": bz2.compress(JSONL),
    "a.jsonl.xz": lzma.compress(JSONL),
    "a.jsonl.zip": zipped("export/a.jsonl", JSONL),
    "gzip-without-suffix.jsonl": gzip.compress(JSONL),
    "bom.jsonl": codecs.BOM_UTF8 + JSONL,
    "crlf.jsonl": JSONL.replace(b"\n", b"\r\n"),
    "ctrl-z.jsonl": JSONL + b"\x1a",
    "blank-lines.jsonl": b"\n" + JSONL.replace(b"\n", b"\n\n  \n") + b"\n",
    "utf16le.jsonl": JSONL.decode("utf-8").replace("\n", "\r\n").encode("utf-16"),      # BOM, then UTF-16 LE
    "utf16be.jsonl": codecs.BOM_UTF16_BE + JSONL.decode("utf-8").encode("utf-16-be"),
    "array.json": json.dumps(RECORDS, ensure_ascii=False, indent=2).encode(),
    "array.json.gz": gzip.compress(json.dumps(RECORDS).encode()),
    "data.json": json.dumps({"data": RECORDS}, indent=1).encode(),
    "rows-and-metadata.json": json.dumps({"version": "data", "num_rows": 3, "rows": RECORDS}).encode(),
    "bom-crlf-array.json": codecs.BOM_UTF8 + json.dumps(RECORDS, indent=2).replace("\n", "\r\n").encode(),
}


@pytest.mark.parametrize("name", list(JSONL_VARIANTS))
def test_each_json_variant_reads_to_the_same_records(write, name):
    assert records_of(write(name, JSONL_VARIANTS[name])) == RECORDS


def test_line_numbers_survive_compression_and_crlf(write):
    lines = [r.line for r in read_file(write("b.jsonl.gz", gzip.compress(JSONL.replace(b"\n", b"\n\r\n"))), "b").records]
    assert lines == [1, 3, 5]


def test_pandas_to_json_layouts(write):
    import pandas as pd

    frame = pd.DataFrame(CSV_RECORDS)
    for orient in ("records", "split", "columns"):
        path = write(f"pandas-{orient}.json", frame.to_json(orient=orient, force_ascii=False))
        assert records_of(path) == CSV_RECORDS, orient
    assert records_of(write("pandas-lines.jsonl", frame.to_json(orient="records", lines=True))) == CSV_RECORDS


CSV_VARIANTS = {
    "a.csv.gz": gzip.compress(CSV.encode()),
    "a.csv.bz2": bz2.compress(CSV.encode()),
    "excel-bom-crlf.csv": codecs.BOM_UTF8 + CSV.replace("\n", "\r\n").encode(),
    "utf16.csv": CSV.replace("\n", "\r\n").encode("utf-16"),
    "ctrl-z.csv": CSV.encode() + b"\x1a",
    "a.tsv.gz": gzip.compress(CSV.replace(",done", "\tdone").replace("prompt,completion", "prompt\tcompletion")
                              .replace("café,🙂", "café\t🙂").replace('?","À', '?"\t"À').encode()),
}


@pytest.mark.parametrize("name", list(CSV_VARIANTS))
def test_each_csv_variant_reads_to_the_same_records(write, name):
    assert records_of(write("plain.csv", CSV)) == CSV_RECORDS
    assert records_of(write(name, CSV_VARIANTS[name])) == CSV_RECORDS


def test_csv_rows_keep_their_lines_in_a_windows_file(write):
    source = read_file(write("w.csv", codecs.BOM_UTF8 + CSV.replace("\n", "\r\n").encode()), "w.csv")
    assert [r.line for r in source.records] == [2, 4, 5]


@pytest.mark.parametrize("compress", [None, gzip.compress])
def test_parquet_reads_to_the_same_records(tmp_path, write, compress):
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(RECORDS), buf)
    name = "a.parquet" if compress is None else "a.parquet.gz"
    data = buf.getvalue() if compress is None else compress(buf.getvalue())
    assert records_of(write(name, data)) == RECORDS


def test_zstd(write):
    """Read for real (make test installs the zstd extra), and named when the package is missing."""
    zstandard = pytest.importorskip("zstandard")
    packed = zstandard.ZstdCompressor().compress(JSONL)
    assert records_of(write("a.jsonl.zst", packed)) == RECORDS
    assert records_of(write("misnamed.jsonl", packed)) == RECORDS          # recognised by its first bytes


def test_zstd_without_the_package_says_what_to_install(write, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "zstandard", None)                    # import zstandard -> ImportError
    with pytest.raises(DataError, match="needs the zstandard package: pip install zstandard"):
        records_of(write("a.jsonl.zst", b"\x28\xb5\x2f\xfd" + b"\x00" * 8))


# --------------------------------------------------------------------------- what is reported

def test_a_bad_line_inside_a_compressed_file_names_its_line(write):
    broken = JSONL + b'{"messages": [}\n'
    with pytest.raises(DataError) as err:
        records_of(write("bad.jsonl.gz", gzip.compress(codecs.BOM_UTF8 + broken.replace(b"\n", b"\r\n"))))
    assert err.value.file == "bad.jsonl.gz" and err.value.line == 4 and "malformed JSON" in err.value.detail


def test_a_damaged_archive_is_reported(write):
    with pytest.raises(DataError, match=r"not a readable gz file .*is it complete\?"):
        records_of(write("cut.jsonl.gz", gzip.compress(JSONL)[:30]))


def test_utf16_without_a_byte_order_mark_is_reported(write):
    with pytest.raises(DataError) as err:
        records_of(write("nobom.jsonl", JSONL.decode().encode("utf-16-le")))
    assert err.value.line == 1 and "looks like UTF-16 text without a byte-order mark" in err.value.detail


def test_a_zip_with_several_files_is_reported(write):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("a.jsonl", JSONL)
        z.writestr("b.jsonl", JSONL)
    with pytest.raises(DataError, match="exactly one data file; this one holds 2: a.jsonl, b.jsonl"):
        records_of(write("two.zip", buf.getvalue()))


def test_a_missing_compressed_file_is_a_local_file_not_a_hub_name(tmp_path):
    assert is_local(tmp_path / "nope.jsonl.gz") and is_local(tmp_path / "nope.csv.zst")
    with pytest.raises(DataError, match="file not found"):
        read_source(tmp_path / "nope.jsonl.gz", "nope.jsonl.gz")
