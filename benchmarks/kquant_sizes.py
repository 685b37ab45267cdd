"""File sizes of Q4_K_M, Q4_K_S and Q4_0: mudpuppy's writer beside llama.cpp's own quantizer on the same input.

    .venv/bin/python benchmarks/kquant_sizes.py --merged DIR      # a merged float32 model (export_quality's work/merged)
    .venv/bin/python benchmarks/kquant_sizes.py --fixtures-only   # only the 256-wide test models

For the merged model: its f32 GGUF (mudpuppy's writer), then each quant written by mudpuppy and by
llama.cpp's `llama_model_quantize` (what llama-quantize calls, through llama-cpp-python) from that f32
file; the two files' tensors are compared byte for byte, and the sizes, the tensor types and how many
tensors llama.cpp's recipe sent to a 32-value fallback type are printed. For the readers tier's test
models (tests/readers/conftest.py: hidden 256, FFN 512, 4 layers; widths a multiple of 256, so K-quants
stay K-quants) the same sizes from mudpuppy's writer, whose K-quant files equal llama.cpp's byte for
byte there (`make test-readers`). Writes benchmarks/results/kquant_sizes-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUANTS = ("q4_0", "q4_k_s", "q4_k_m")
FIXTURE_FAMILIES = ("qwen3", "phi3", "smollm3", "gemma3")


def tensor_summary(path: Path) -> dict:
    import gguf

    tensors = gguf.GGUFReader(str(path)).tensors
    return {"bytes": path.stat().st_size, "types": dict(Counter(t.tensor_type.name for t in tensors)),
            "weights": sum(int(t.n_elements) for t in tensors)}


def same_tensors(a: Path, b: Path) -> list[str]:
    """The tensors whose type or bytes differ between two GGUF files (names only)."""
    import gguf
    import numpy as np

    x = {t.name: t for t in gguf.GGUFReader(str(a)).tensors}
    y = {t.name: t for t in gguf.GGUFReader(str(b)).tensors}
    out = sorted(set(x) ^ set(y))
    for name in sorted(set(x) & set(y)):
        if x[name].tensor_type != y[name].tensor_type or not np.array_equal(
                np.asarray(x[name].data).view(np.uint8), np.asarray(y[name].data).view(np.uint8)):
            out.append(name)
    return out


def merged_sizes(merged: Path, work: Path) -> dict:
    sys.path.insert(0, str(REPO))
    from tests.readers.cpp import quantize
    from transformers import AutoTokenizer

    from mudpuppy.export.gguf import write_gguf

    tok = AutoTokenizer.from_pretrained(merged)
    f32 = work / "model-f32.gguf"
    write_gguf(merged, tok, tok.chat_template, "f32", f32, "merged")
    rows = {}
    for quant in QUANTS:
        ours, theirs = work / f"ours-{quant}.gguf", work / f"llama-{quant}.gguf"
        started = time.monotonic()
        write_gguf(merged, tok, tok.chat_template, quant, ours, "merged")
        took = time.monotonic() - started
        quantize(f32, theirs, quant)
        row = {"mudpuppy": tensor_summary(ours), "llama_cpp": tensor_summary(theirs), "write_seconds": round(took, 1),
               "differing_tensors": same_tensors(ours, theirs)}
        rows[quant] = row
        print(f"{quant}: mudpuppy {row['mudpuppy']['bytes'] / 1e6:.2f} MB, llama.cpp {row['llama_cpp']['bytes'] / 1e6:.2f} MB, "
              f"{len(row['differing_tensors'])} tensors differ; types {row['llama_cpp']['types']}", flush=True)
        ours.unlink()
        theirs.unlink()
    return rows


def fixture_sizes(work: Path) -> dict:
    sys.path.insert(0, str(REPO))
    from tests.readers.conftest import Models

    models = Models(work)
    out = {}
    for family in FIXTURE_FAMILIES:
        _, _, _, config = models.model(family)
        row = {"hidden_size": config["hidden_size"], "intermediate_size": config["intermediate_size"],
               "tied": bool(config.get("tie_word_embeddings"))}
        for quant in QUANTS:
            row[quant] = tensor_summary(models.gguf(family, quant))
        out[family] = row
        print(f"{family} (hidden {row['hidden_size']}): " + ", ".join(
            f"{q} {row[q]['bytes'] / 1e3:.1f} kB" for q in QUANTS), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--merged", type=Path, help="a merged float32 model directory")
    ap.add_argument("--fixtures-only", action="store_true", help="only the 256-wide test models")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / f"kquant_sizes-{date.today()}.json")
    args = ap.parse_args()
    if args.merged is None and not args.fixtures_only:
        raise SystemExit("kquant_sizes: give --merged DIR (a merged float32 model) or --fixtures-only")
    if args.merged is not None and not (args.merged / "config.json").is_file():
        raise SystemExit(f"kquant_sizes: --merged {args.merged}: no config.json there (a merged model directory?)")
    result = {"date": str(date.today()), "command": "python benchmarks/kquant_sizes.py " + " ".join(sys.argv[1:])}
    with tempfile.TemporaryDirectory(prefix="kquant-sizes-") as tmp:
        if args.merged is not None:
            result["merged"] = {"model": str(args.merged), "quants": merged_sizes(args.merged, Path(tmp))}
        result["fixtures"] = fixture_sizes(Path(tmp) / "fixtures")
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
