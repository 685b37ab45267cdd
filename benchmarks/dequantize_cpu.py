"""Dequantizing a 4-bit layer on this CPU: eager, compiled into a fresh tensor, compiled into a reused one.

    python benchmarks/dequantize_cpu.py                 # the 1.07B Llama's layer shapes, int4 and mxfp4
    python benchmarks/dequantize_cpu.py --repeat 50 --formats int4

What a QLoRA step adds to a LoRA step is the frozen weights rebuilt from
their 4-bit codes, three times per layer with gradient checkpointing
(forward, recompute, backward). Three ways of doing it, in one process, for
each weight shape of the 1.07B Llama of benchmarks/memory_scale.py (hidden
2048, intermediate 5632, 4 KV heads) and for bf16 output (what a bf16-native
CPU computes in):

    eager     quant_formats.dequantize_weight: unpack, convert, scale, cast, each a pass
    fresh     the fused kernel mudpuppy compiles per shape, returning a new tensor
    reused    the same kernel writing into a buffer kept between calls, as training does
              (frozen.scratch_weight)

with glibc told to hand freed buffers of 1 MiB and more back to the system,
as mudpuppy's runs do (memory.return_freed_host_memory): a fresh tensor then
pays a page fault per 4 KiB on first touch, which is what `reused` avoids.
For scale, the bf16 matmul each rebuilt weight serves (1024 tokens: micro batch
4 x 256) is timed too. Each figure is the median of --repeat calls after two
warm-up calls; every result is checked equal to the eager one.
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPES = {"q_proj/o_proj": (2048, 2048), "k_proj/v_proj": (512, 2048), "gate_proj/up_proj": (5632, 2048),
          "down_proj": (2048, 5632)}


def median_ms(fn, repeat: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--formats", default="int4,mxfp4")
    args = ap.parse_args()

    import torch

    from mudpuppy.backends.torch.quantization import linear4bit as quantize
    from mudpuppy.backends.torch.memory import return_freed_host_memory
    from mudpuppy.backends.torch.quantization.formats import dequantize_weight, quantize_weight

    return_freed_host_memory()
    dtype = torch.bfloat16
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, output {dtype}, median of {args.repeat}")
    print(f"{'format':7} {'layer':18} {'shape':>11} {'eager':>8} {'fresh':>8} {'reused':>8} {'matmul':>8}  reused vs eager")
    for backend in args.formats.split(","):
        for name, (rows, cols) in SHAPES.items():
            weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
            tensors = quantize_weight(weight, backend, 64)
            expected = dequantize_weight(tensors, backend, cols, dtype)
            buffer = torch.empty(rows, cols, dtype=dtype)
            fresh = quantize._dequantize_on_cpu(tensors, backend, cols, dtype, None)
            reused = quantize.fast_dequantize(tensors, backend, cols, dtype, out=buffer)
            if not (torch.equal(fresh, expected) and torch.equal(reused, expected)):
                raise SystemExit(f"{backend} {name}: the fused kernel differs from the eager values")
            x = torch.randn(1024, cols, dtype=dtype)
            eager_ms = median_ms(lambda: dequantize_weight(tensors, backend, cols, dtype), args.repeat)
            fresh_ms = median_ms(lambda: quantize._dequantize_on_cpu(tensors, backend, cols, dtype, None), args.repeat)
            reused_ms = median_ms(lambda: quantize.fast_dequantize(tensors, backend, cols, dtype, out=buffer),
                                  args.repeat)
            matmul_ms = median_ms(lambda: x @ expected.T, args.repeat)
            print(f"{backend:7} {name:18} {rows:>5}x{cols:<5} {eager_ms:8.2f} {fresh_ms:8.2f} {reused_ms:8.2f} "
                  f"{matmul_ms:8.2f}  {eager_ms / reused_ms:.1f}x")
    print("milliseconds per call")


if __name__ == "__main__":
    main()
