"""K-quants written in numpy against llama.cpp's own quantizer: the golden fixtures hold the bytes
ggml-quants.c (compiled from the llama-cpp-python sdist by benchmarks/kquant_fixtures.py) wrote for
the same rows, without and with importance weights; gguf's dequantizer reads ours back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mudpuppy.export import kquants
from mudpuppy.export.kquants import BLOCK, quantize, row_bytes

FIXTURES = np.load(Path(__file__).parent / "fixtures" / "kquants.npz")
ROWS = FIXTURES["rows"]
NAMES = [str(n) for n in FIXTURES["names"]]
TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q5_0", "Q5_1", "Q8_0"]
WEIGHTS = [None, "imatrix", "flat"]


def differing_rows(ours: np.ndarray, ref: np.ndarray) -> list[str]:
    return [NAMES[i] for i in range(len(ROWS)) if not np.array_equal(ours[i], ref[i])]


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("qtype", TYPES)
def test_bytes_equal_llama_cpp(qtype, weights):
    key = qtype if weights is None else f"{qtype}_{weights}"
    ref = FIXTURES[key].reshape(len(ROWS), -1)
    qw = None if weights is None else FIXTURES[f"weights_{weights}"]
    ours = quantize(ROWS, qtype, qw)
    assert ours.shape == ref.shape
    assert differing_rows(ours, ref) == []


def test_fixtures_cover_the_edge_rows():
    for name in ("zeros", "constant", "huge_range", "negative_only", "tiny", "signed_zeros", "ties"):
        assert name in NAMES
    assert np.signbit(ROWS[NAMES.index("signed_zeros")]).any()
    assert (FIXTURES["weights_imatrix"] == 0).any()            # never-active columns


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_dequantizes_our_blocks(qtype):
    import gguf
    from gguf.quants import dequantize

    rng = np.random.default_rng(7)
    rows = (rng.standard_normal((6, 768)) * 0.02).astype(np.float32)
    for qw in (None, (rng.random(768) + 0.1).astype(np.float32)):
        back = dequantize(quantize(rows, qtype, qw), getattr(gguf.GGMLQuantizationType, qtype))
        rel = np.sqrt(((back - rows) ** 2).mean()) / np.sqrt((rows ** 2).mean())
        bound = {"Q2_K": 0.45, "Q3_K": 0.2, "Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025}[qtype]
        assert rel < bound, (qtype, rel)
    ref = dequantize(FIXTURES[qtype].reshape(len(ROWS), -1), getattr(gguf.GGMLQuantizationType, qtype))
    ours = dequantize(quantize(ROWS, qtype), getattr(gguf.GGMLQuantizationType, qtype))
    np.testing.assert_array_equal(ours, ref)


def test_more_bits_less_error():
    rng = np.random.default_rng(3)
    rows = (rng.standard_normal((4, 512)) * 0.05).astype(np.float32)
    import gguf
    from gguf.quants import dequantize

    errors = [np.abs(dequantize(quantize(rows, t), getattr(gguf.GGMLQuantizationType, t)) - rows).mean()
              for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")]
    assert errors == sorted(errors, reverse=True)


def test_chunks_and_shapes_do_not_change_bytes(monkeypatch):
    rng = np.random.default_rng(5)
    stacked = (rng.standard_normal((2, 5, 512)) * 0.1).astype(np.float32)      # [experts, rows, cols]
    qw = rng.random(512).astype(np.float32)
    whole = quantize(stacked, "Q4_K", qw)
    assert whole.shape == (2, 5, row_bytes("Q4_K", 512))
    monkeypatch.setattr(kquants, "CHUNK", 700)                                  # one row per chunk
    np.testing.assert_array_equal(quantize(stacked.reshape(10, 512), "Q4_K", qw), whole.reshape(10, -1))


def test_row_length_must_fill_blocks():
    with pytest.raises(ValueError, match="not a whole number of 256-value blocks"):
        quantize(np.zeros((2, 320), np.float32), "Q4_K")
    assert BLOCK["Q5_0"] == (32, 22)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_reads_our_blocks_as_llama_cpp_does(qtype):
    """gguf's dequantizer on our blocks equals ggml's dequantize_row_<type> on the same bytes."""
    import gguf
    from gguf.quants import dequantize

    ref = FIXTURES[f"{qtype}_dequantized"]
    rows = ROWS[: ref.size // ROWS.shape[1]]
    ours = dequantize(quantize(rows, qtype), getattr(gguf.GGMLQuantizationType, qtype)).reshape(-1)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))
