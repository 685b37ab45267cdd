"""Preference pairs at size: peak memory and time of preparing N pairs for DPO, token store against lists.

    .venv/bin/python benchmarks/pair_scale.py --sizes 10000,200000 [--num-proc 2] \
        [--sides store,lists] [--out benchmarks/results/pair_scale.json]

For each size a seeded generator writes preference pairs of realistic length
(a system line and a question as a chat prompt; chosen and rejected answers of
three to five sentences, about 250 SmolLM2 tokens a sequence with the prompt)
to a JSONL file. Then, each in its own process, the data is loaded and
prepared for `dpo` (uncached: `prepare_data`, as a run does before training):

- store: today's path: the file scanned, read again in chunks, tokenized in
  `num_proc` workers into the memory-mapped pair store;
- lists: the path before it (`prepare.tokenize_all`'s in-memory lists, every
  record held), forced in the child by the same switches the equivalence
  tests use.

Peak RSS is the child's own `ru_maxrss` and its workers' largest (not their
sum). Seconds are load + prepare inside the child (imports and the tokenizer
load left out). The 1-minute load average is read before and after each side:
run it on a quiet machine, or say what else was running.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_scale import PYTHON, sentence  # noqa: E402  (the same seeded words)

CHILD = """
import json, resource, sys, time
from mudpuppy.backends.models import resolve_model
from mudpuppy.configure import load_config
from mudpuppy.data import load_data, load_tokenizer, prepare_data
from mudpuppy.data import prepare

cfg, side = load_config(sys.argv[1], check_files=False), sys.argv[2]
if side == "lists":
    prepare.STREAMED = ("sft",)
    prepare.stored = lambda method, loaded: method == "sft"
tok = load_tokenizer(cfg.model, resolve_model(cfg.model.base_model).path)
start = time.perf_counter()
data = prepare_data(cfg, tok, load_data(cfg, "dpo"), method="dpo", use_cache=False)
seconds = time.perf_counter() - start
mine, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
tokens = sum(len(s) for p in data.train[:1000] for s in p.sequences())
print(json.dumps({"pairs": len(data.train), "tokens_first_1000": tokens, "seconds": seconds,
                  "kind": type(data.train).__name__, "peak_mb": mine.ru_maxrss / 1024,
                  "workers_peak_mb": workers.ru_maxrss / 1024}))
"""


def write_pairs(path: Path, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            prompt = [{"role": "system", "content": "You run the house. Answer in full sentences."},
                      {"role": "user", "content": sentence(rng, rng.randint(8, 20)).rstrip(".") + "?"}]
            chosen, rejected = (" ".join(sentence(rng, rng.randint(14, 26)) for _ in range(rng.randint(3, 5)))
                                for _ in range(2))
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def side(data: Path, work: Path, name: str, num_proc: int) -> dict:
    import yaml

    cfg = {"model": {"base_model": "smollm2-135m-instruct"}, "method": "preference", "preference": {"type": "dpo"},
           "data": {"datasets": [{"path": str(data)}], "sequence_len": 1024, "num_proc": num_proc, "cache": False,
                    "cache_dir": str(work / "cache")},
           "output_dir": str(work / "out")}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    load_before = load_average()
    done = subprocess.run([PYTHON, "-c", CHILD, str(path), name], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-4000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "side": name, "load_before": load_before,
            "load_after": load_average()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,200000")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--sides", default="store,lists")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for size in (int(s) for s in args.sizes.split(",")):
            data = work / f"pairs-{size}.jsonl"
            write_pairs(data, size)
            for name in args.sides.split(","):
                row = {"size": size, "file_mb": data.stat().st_size / 2**20, **side(data, work, name, args.num_proc)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| pairs | side | seconds | pairs/s | peak RSS MB | workers' peak MB | load avg before/after |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']:,} | {r['side']} | {r['seconds']:.1f} | {r['pairs'] / r['seconds']:,.0f} | "
              f"{r['peak_mb']:.0f} | {r['workers_peak_mb']:.0f} | {r['load_before']:.2f} / {r['load_after']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                        "argv": sys.argv[1:], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
