"""Where one GRPO sampling call spends its time: mudpuppy's `backend.sample` alone, timed and profiled.

    python benchmarks/grpo_sample_profile.py                 # 3 timed calls, then one under torch.profiler
    python benchmarks/grpo_sample_profile.py --shapes        # the profile grouped by input shape
    python benchmarks/grpo_sample_profile.py --threads 2 --precision fp32

The call is what a step of benchmarks/grpo_cpu.py samples: SmolLM2-135M-Instruct (embedded) with
configs/grpo.yaml's LoRA (r 16, alpha 32, all linear layers; the adapter as attached, B = 0), the first
two prompts of configs/data/arithmetic_rl_train.jsonl in the chat template, 8 completions each with a seed
per group, temperature 0.7, top_p 1, top_k 0. No stop token, so every row decodes all --tokens tokens and
the calls are the same length on every run and machine. Two untimed calls warm it up first.

docs/benchmarks.md's "where mudpuppy's sampling time goes" table is this script's output (default
settings, one thread, the project's AMD EPYC, quiet machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "configs" / "data" / "arithmetic_rl_train.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens a row (no stop token)")
    ap.add_argument("--repeat", type=int, default=3, help="timed calls before the profiled one")
    ap.add_argument("--shapes", action="store_true", help="group the profile by input shape")
    ap.add_argument("--rows", type=int, default=14, help="rows of the profile table")
    args = ap.parse_args()

    import torch
    from torch.profiler import profile

    from mudpuppy import create_backend
    from mudpuppy.backends.protocol import Sampling
    from mudpuppy.config import AdapterConfig, ModelConfig

    torch.set_num_threads(args.threads)
    backend = create_backend("cpu")
    handle = backend.load_model(ModelConfig(base_model="smollm2-135m-instruct"), args.precision)
    backend.attach_adapter(handle, AdapterConfig(type="lora", r=16, alpha=32, dropout=0.0,
                                                 target_modules="all-linear"))
    tokenizer = handle.tokenizer
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:2]]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=True)
                    ["input_ids"]) for r in rows]
    batch = [p for p in prompts for _ in range(8)]
    seeds = [group for group in range(len(prompts)) for _ in range(8)]
    sampling = Sampling(temperature=0.7, top_p=1.0, top_k=0)

    def call():
        return backend.sample(handle, batch, args.tokens, [], sampling, seed=seeds)

    for _ in range(2):
        call()
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    print(f"{len(batch)} rows x {args.tokens} tokens, {args.threads} thread(s), {handle.describe()}: "
          f"median {statistics.median(times):.2f} s (min {min(times):.2f}, max {max(times):.2f}) over {args.repeat} calls")
    with profile(record_shapes=args.shapes) as prof:
        call()
    table = prof.key_averages(group_by_input_shape=args.shapes)
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
