"""The passes over preference data and what planning KTO batches costs, in one process.

    .venv/bin/python benchmarks/data_passes.py [--pairs 20000] [--kto-copies 40] [--num-proc 2]

- pairs: `--pairs` seeded preference pairs (pair_scale.py's generator: a chat
  prompt, two answers of 3-5 sentences) in a JSONL file over stream.KEEP, so
  streamed; the seconds of the checking scan (`load_data`), of screening
  (`screen_records`: identical pairs, empty answers; the file read once more in
  `num_proc` workers) and of tokenizing into the pair store (`prepare_data`,
  uncached), SmolLM2-135M-Instruct's tokenizer.
- KTO: the smart-home KTO sample files repeated `--kto-copies` times,
  `sequence_len` 128: seconds of `kto_items(view).lengths` (the store's arrays)
  against building every item to measure it (what `lengths` did before), and
  whether the two arrays are equal.

Wall seconds beside the 1-minute load average: say what else was running.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--kto-copies", type=int, default=40)
    parser.add_argument("--num-proc", type=int, default=2)
    args = parser.parse_args()

    import numpy as np
    from pair_scale import write_pairs
    from transformers import AutoTokenizer

    from mudpuppy.backends.models import resolve_model
    from mudpuppy.configure import load_config
    from mudpuppy.data import load_data, prepare_data
    from mudpuppy.data.pairs import kto_items, screen_records

    model = str(resolve_model("smollm2-135m-instruct").path)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        def config(path: Path, sequence_len: int):
            return load_config({"model": {"base_model": model},
                                "data": {"datasets": [{"path": str(path)}], "sequence_len": sequence_len,
                                         "num_proc": args.num_proc, "cache_dir": str(tmp / "cache")},
                                "output_dir": str(tmp / "out")}, check_files=False)

        write_pairs(tmp / "pairs.jsonl", args.pairs)
        cfg = config(tmp / "pairs.jsonl", 1024)
        t = time.perf_counter()
        loaded = load_data(cfg, "dpo")
        scan = time.perf_counter() - t
        t = time.perf_counter()
        bad = screen_records(loaded.train, args.num_proc).bad
        screen = time.perf_counter() - t
        t = time.perf_counter()
        prepare_data(cfg, AutoTokenizer.from_pretrained(model), loaded, method="dpo", use_cache=False)
        tokenize = time.perf_counter() - t
        print(f"{args.pairs:,} pairs, num_proc {args.num_proc}: scan {scan:.1f} s, screening {screen:.1f} s "
              f"({len(bad)} bad), tokenizing {tokenize:.1f} s; load {os.getloadavg()[0]:.1f}")

        samples = ROOT / "configs" / "data"
        lines = [line for name in ("smart_home_kto_train.jsonl", "smart_home_kto_val.jsonl")
                 for line in (samples / name).read_text().splitlines()] * args.kto_copies
        (tmp / "kto.jsonl").write_text("\n".join(lines) + "\n")
        cfg = config(tmp / "kto.jsonl", 128)
        data = prepare_data(cfg, AutoTokenizer.from_pretrained(model), load_data(cfg, "kto"), method="kto",
                            use_cache=False)
        items = kto_items(data.train, 128)
        t = time.perf_counter()
        built = np.fromiter((len(items[i]) for i in range(len(items))), dtype=np.int64, count=len(items))
        old = time.perf_counter() - t
        t = time.perf_counter()
        arrays = kto_items(data.train, 128).lengths
        new = time.perf_counter() - t
        print(f"{len(items):,} KTO items: lengths from the store's arrays {new:.3f} s, building each item "
              f"{old:.3f} s, equal: {np.array_equal(built, arrays)}; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
