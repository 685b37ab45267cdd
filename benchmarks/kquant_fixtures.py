"""Golden fixtures for the K-quant writer (src/export/kquants.py), from llama.cpp's own quantizer.

The oracle is ggml's `ggml/src/ggml-quants.c` alone, taken from the `llama-cpp-python` sdist on PyPI
(which vendors llama.cpp) and compiled here into a small shared library called through ctypes; no
llama.cpp build, no llama-cpp-python install. The four ggml functions that file calls from ggml.c
(row sizes, type names, abort) are given by a stub below.

    .venv/bin/python benchmarks/kquant_fixtures.py                      # downloads the sdist (76 MB)
    .venv/bin/python benchmarks/kquant_fixtures.py --sdist /tmp/lcp/llama_cpp_python-0.3.36.tar.gz

Writes tests/export/fixtures/kquants.npz: input rows (random weights and the edge rows: zeros,
constant, huge dynamic range, negative-only, tiny values, outliers), importance weights, and the
reference's bytes for Q2_K..Q6_K and the 32-block fallbacks Q4_0, Q5_0, Q5_1, Q8_0, each without and
with quant_weights (quantize_<type>(src, dst, nrow, n_per_row, quant_weights), the function
llama-quantize reaches through ggml_quantize_chunk), and ggml's dequantize_row_<type> of the first
K-quant rows (what llama.cpp reads back from those blocks).

Compiler flags: ggml builds ggml-quants.c into ggml-base without -march=native (ggml/src/CMakeLists.txt
puts the arch flags on ggml-cpu only), so on x86-64 nothing is fused into FMA; -ffp-contract=off says
the same on any host. An aarch64 build of llama.cpp may contract multiply-adds and differ in the last
bit of a rare block.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "export" / "fixtures" / "kquants.npz"
DEQUANTIZED = 10                 # rows whose blocks are also stored as llama.cpp dequantizes them

# ggml_type enum value, block size, bytes per block (ggml.h, ggml-common.h)
TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24),
         "Q8_0": (8, 32, 34), "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144),
         "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}

STUB = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <stdint.h>
static const int types[][3] = {%s};
static const int *find(int t) {
    for (size_t i = 0; i < sizeof(types)/sizeof(types[0]); ++i) if (types[i][0] == t) return types[i];
    fprintf(stderr, "stub: type %%d unknown\n", t); abort();
}
void ggml_abort(const char *file, int line, const char *fmt, ...) { fprintf(stderr, "%%s:%%d\n", file, line); abort(); }
size_t ggml_type_size(int t) { return find(t)[2]; }
size_t ggml_row_size(int t, int64_t ne) { const int *r = find(t); return (size_t)r[2] * ne / r[1]; }
const char *ggml_type_name(int t) { (void)t; return "?"; }
"""


def extract(sdist: Path, into: Path) -> Path:
    """ggml's sources and headers from the sdist; returns the ggml directory."""
    wanted = ("ggml/src/ggml-quants.", "ggml/src/ggml-impl.h", "ggml/src/ggml-common.h", "ggml/include/",
              "ggml/src/ggml-cpu/")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "vendor/llama.cpp/" in m.name
                   and any(w in m.name for w in wanted) and (m.isfile() or m.isdir())]
        tar.extractall(into, members=members, filter="data")
    return next(into.rglob("vendor/llama.cpp/ggml"))


def build(ggml: Path, work: Path) -> ctypes.CDLL:
    rows = ", ".join(f"{{{t}, {b}, {s}}}" for t, b, s in TYPES.values())
    stub = work / "stub.c"
    stub.write_text(STUB % rows)
    lib = work / "libggmlquants.so"
    subprocess.run(["gcc", "-O2", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11", "-DNDEBUG",
                    f"-I{ggml / 'include'}", f"-I{ggml / 'src'}", str(ggml / "src" / "ggml-quants.c"), str(stub),
                    "-o", str(lib), "-lm"], check=True)
    return ctypes.CDLL(str(lib))


def quantize(lib: ctypes.CDLL, name: str, rows: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    _, block, size = TYPES[name]
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    nrow, n = rows.shape
    out = np.zeros(nrow * n // block * size, dtype=np.uint8)
    fn = getattr(lib, f"quantize_{name[0].lower()}{name[1:]}")
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    qw = None if weights is None else np.ascontiguousarray(weights, dtype=np.float32)
    written = fn(rows.ctypes.data, out.ctypes.data, nrow, n, None if qw is None else qw.ctypes.data)
    assert written == out.size, (name, written, out.size)
    return out


def dequantize(lib: ctypes.CDLL, name: str, blocks: np.ndarray, n: int) -> np.ndarray:
    """ggml's dequantize_row_<type> of `blocks` (the reader's side, to check gguf's dequantizer by)."""
    out = np.zeros(n, dtype=np.float32)
    fn = getattr(lib, f"dequantize_row_{name[0].lower()}{name[1:]}")
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    fn(blocks.ctypes.data, out.ctypes.data, n)
    return out


def edge_rows(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One row of each shape that takes a different path through the C code."""
    normal = rng.standard_normal(n).astype(np.float32)
    half = normal.copy()
    half[: n // 2] = 0
    spikes = (normal * 0.02).astype(np.float32)
    spikes[rng.choice(n, 6, replace=False)] = [40.0, -35.0, 12.0, -60.0, 7.5, 100.0]
    return {
        "zeros": np.zeros(n, np.float32),
        "constant": np.full(n, 0.37, np.float32),
        "constant_negative": np.full(n, -1.25, np.float32),
        "huge_range": (normal * 10.0 ** rng.uniform(-8, 3.5, n)).astype(np.float32),
        "negative_only": -np.abs(normal),
        "positive_only": np.abs(normal) * 0.05,
        "tiny": normal * np.float32(1e-18),
        "small": normal * np.float32(3e-6),
        "half_zero": half * 0.1,
        "outliers": spikes,
        "sparse": np.where(rng.random(n) < 0.9, 0, normal).astype(np.float32),
        # zeros of both signs and values on a coarse grid: the ties and the sign of zero the C keeps
        "signed_zeros": np.where(rng.random(n) < 0.5, 0.0, -0.0).astype(np.float32),
        "signed_zeros_sparse": np.where(rng.random(n) < 0.97, np.where(rng.random(n) < 0.5, 0.0, -0.0),
                                        np.abs(normal)).astype(np.float32),
        "ties": (np.round(normal * 8) / 16).astype(np.float32),
    }


def make_inputs(seed: int = 0, n: int = 512) -> tuple[np.ndarray, list[str], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    edges = edge_rows(n, rng)
    random = (rng.standard_normal((8, n)) * rng.uniform(0.005, 0.1, (8, 1))).astype(np.float32)
    rows = np.vstack([random, np.stack(list(edges.values()))]).astype(np.float32)
    names = [f"random{i}" for i in range(len(random))] + list(edges)
    # importance weights as llama-imatrix writes them: per-column mean squares, some columns never active
    imatrix = (rng.standard_normal(n) ** 2 * rng.uniform(0.1, 3.0, n)).astype(np.float32)
    imatrix[rng.choice(n, 20, replace=False)] = 0
    flat = np.ones(n, np.float32)
    return rows, names, {"imatrix": imatrix, "flat": flat}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, help="llama_cpp_python-*.tar.gz (else pip downloads it)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sdist = args.sdist
        if sdist is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "llama-cpp-python", "-d", str(work)], check=True)
            sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
        lib = build(extract(sdist, work), work)
        rows, names, weights = make_inputs()
        fixtures = {"rows": rows, "names": np.array(names), "sdist": np.array(sdist.name)}
        for key, w in weights.items():
            fixtures[f"weights_{key}"] = w
        for name in TYPES:
            if name == "Q4_1":
                continue
            fixtures[f"{name}"] = quantize(lib, name, rows, None)
            if name.endswith("_K"):        # llama.cpp's reading of the first DEQUANTIZED rows' blocks
                head = fixtures[name][: DEQUANTIZED * fixtures[name].size // len(rows)]
                fixtures[f"{name}_dequantized"] = dequantize(lib, name, head, DEQUANTIZED * rows.shape[1])
            for key, w in weights.items():
                fixtures[f"{name}_{key}"] = quantize(lib, name, rows, w)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **fixtures)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes) from {sdist.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
