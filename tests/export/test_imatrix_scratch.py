"""benchmarks/imatrix_scratch.py's own logic: the held-out split, the records it cuts, and the per-seed
arithmetic its table and the docs' figures come from."""

from __future__ import annotations

import importlib.util
import json
import math

from ..conftest import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("imatrix_scratch", REPO / "benchmarks" / "imatrix_scratch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_held_out_files_are_not_trained_on(tmp_path):
    bench = _bench()
    info = bench.write_corpus(tmp_path)
    files = bench.stdlib_files()
    held = [p for p in files if bench.held_out(p)]
    assert 0 < len(held) < len(files) / 5                    # about one file in ten
    val = [json.loads(line)["text"] for line in (tmp_path / "val.jsonl").read_text().splitlines()]
    train = {json.loads(line)["text"] for line in (tmp_path / "train.jsonl").read_text().splitlines()}
    assert len(val) == info["val_records"] == bench.HELD_OUT_RECORDS
    first = held[0].read_text(encoding="utf-8")
    assert val[0] == bench.chunks(first)[0]                   # file order, whole lines
    # the run reads the first 64 (data.val_datasets num_samples): none occurs verbatim in a training file
    # (further down, the encodings' charmap tables repeat across files)
    assert not set(val[:64]) & train


def test_chunks_keep_lines_whole_and_bounded():
    bench = _bench()
    text = "".join(f"line {i} " + "x" * (i % 50) + "\n" for i in range(500))
    got = bench.chunks(text)
    assert "".join(got) == text
    assert all(len(c) <= bench.CHUNK_CHARS and c.endswith("\n") for c in got)


def _seed(merged: float, **types: float) -> dict:
    rows = [{"type": "merged (float32)", "perplexity": merged, "bytes": 10}]
    return {"rows": rows + [{"type": t.replace("_im", " + imatrix"), "perplexity": v, "llama_cpp_perplexity": v * 1.001,
                             "bytes": 5} for t, v in types.items()]}


def test_medians_pair_each_type_with_its_own_seed():
    bench = _bench()
    seeds = {"1": _seed(100.0, q4_k_m=101.0, q4_k_m_im=100.5), "2": _seed(200.0, q4_k_m_im=204.0),
             "3": _seed(300.0, q4_k_m=303.0, q4_k_m_im=306.0)}
    rows = {r["type"]: r for r in bench.medians(list(seeds.values()))}
    # seed 2 has no q4_k_m: its merged model must not be paired with seed 3's file
    assert rows["q4_k_m"]["seeds"] == 2 and [round(x, 9) for x in rows["q4_k_m"]["vs_merged"]["each"]] == [0.01, 0.01]
    assert math.isclose(rows["q4_k_m + imatrix"]["vs_merged"]["median"], 0.02)
    gain = bench.imatrix_gain(seeds)
    assert set(gain) == {"1", "3"} and math.isclose(gain["1"]["perplexity"], 100.5 / 101 - 1)
    assert "| q4_k_m + imatrix | 0.00 MB | 100.50 (100.60), 204.00 (204.20), 306.00 (306.31) |" in bench.table(
        bench.medians(list(seeds.values())))
