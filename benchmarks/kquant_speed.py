"""Time and peak memory of the Python K-quant writer on a 1B-shaped model (random weights).

    .venv/bin/python benchmarks/kquant_speed.py                    # Llama-3.2-1B's shapes, Q4_K_M
    .venv/bin/python benchmarks/kquant_speed.py --quant q6_k --layers 4

The tensors are Llama-3.2-1B's (hidden 2048, MLP 8192, 16 layers, 32 heads / 8 KV heads, vocabulary
128256, tied embedding: 1.24B weights), drawn one at a time and quantized as export/gguf.py writes them:
each tensor's type from kquant_recipes (Q4_K_M: token_embd and half of attn_v / ffn_down Q6_K, the rest
Q4_K), its blocks from kquants.quantize. Prints the time per type, the total, the peak RSS and the load
average, since the dev machines are shared.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import numpy as np

from mudpuppy.export.kquant_recipes import ModelInfo, tensor_types
from mudpuppy.export.kquants import quantize


def shapes(layers: int, hidden: int = 2048, ffn: int = 8192, kv: int = 512, vocab: int = 128256) -> dict:
    out = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        out.update({f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv, hidden),
                    f"blk.{i}.attn_v.weight": (kv, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                    f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                    f"blk.{i}.ffn_down.weight": (hidden, ffn), f"blk.{i}.attn_norm.weight": (hidden,),
                    f"blk.{i}.ffn_norm.weight": (hidden,)})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default="q4_k_m")
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    tensors = shapes(args.layers)
    types = tensor_types(tensors, args.quant, ModelInfo("llama", args.layers, 32, 8))
    rng = np.random.default_rng(0)
    per_type: dict[str, list[float]] = {}
    values = 0
    start = time.perf_counter()
    for name, qtype in types.items():
        if qtype is None:
            continue
        w = rng.standard_normal(tensors[name], dtype=np.float32) * np.float32(0.02)
        t0 = time.perf_counter()
        quantize(w, qtype)
        spent = time.perf_counter() - t0
        per_type.setdefault(qtype, [0.0, 0])
        per_type[qtype][0] += spent
        per_type[qtype][1] += w.size
        values += w.size
        del w
    total = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for qtype, (spent, n) in sorted(per_type.items()):
        print(f"{qtype}: {n / 1e6:8.1f}M values in {spent:7.1f} s ({n / spent / 1e6:5.2f}M/s)")
    print(f"{args.quant}: {values / 1e9:.3f}B values, {total:.1f} s in all (random draws included), "
          f"peak RSS {peak:.0f} MiB, load average {os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
