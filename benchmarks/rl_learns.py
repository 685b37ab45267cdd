"""Does an online RL method learn? Held-out greedy reward before vs after, and the sampled reward's rise, over
seeds, each method run from its own config in configs/ (GRPO's small sums for grpo, rloo and online_dpo).

    python benchmarks/rl_learns.py --methods rloo,online_dpo --seeds 42,11,7 --steps 20 --threads 1
    python benchmarks/rl_learns.py --table-only --out benchmarks/results/rl_learns-2026-11-27.json

Each cell is `mudpuppy run -c configs/<method>.yaml` in its own process, with training.max_steps,
training.seed and output_dir overridden (--set); nothing else changes, so a cell is what a user of the
config gets at that step count. Read back: run_summary.json's eval_before / eval_after (the weighted
reward of greedy completions on the config's held-out prompts, and each reward function's mean: exact
match is `exact_match`'s) and metrics.jsonl's sampled reward per optimizer step (the mean of the first
and of the last five steps). Every cell is appended to --out as it finishes; a rerun skips the cells
already there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import load_results, machine, save_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"grpo": "grpo.yaml", "rloo": "rloo.yaml", "online_dpo": "online-dpo.yaml"}
DEFAULT_OUT = REPO / "benchmarks" / "results" / f"rl_learns-{date.today().isoformat()}.json"
EXACT = "eval_rewards/exact_match/mean"
WINDOW = 5


def run_cell(method: str, seed: int, steps: int, work: Path, threads: int | None) -> dict:
    out = work / f"{method}-{seed}-{steps}"
    config = REPO / "configs" / CONFIGS[method]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "mudpuppy", "run", "-c", str(config), "--overwrite",
           "--set", f"training.max_steps={steps}", "--set", f"training.seed={seed}",
           "--set", f"output_dir={out}", "--set", "logging.progress_bar=false"]
    start = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"{method} seed {seed}: mudpuppy run failed ({res.returncode}):\n{res.stderr[-3000:]}")
    summary = json.loads((out / "run_summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    sampled = [r["reward"] for r in rows if "reward" in r and "loss" in r]
    if len(sampled) != steps:
        raise SystemExit(f"{method} seed {seed}: {len(sampled)} steps logged a sampled reward, expected {steps}")
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    if "eval_reward" not in before or "eval_reward" not in after:
        raise SystemExit(f"{method} seed {seed}: run_summary.json has no held-out reward before and after "
                         f"(eval_before {before}, eval_after {after})")
    return {"method": method, "seed": seed, "steps": steps, "config": f"configs/{CONFIGS[method]}",
            "heldout_reward_before": before["eval_reward"], "heldout_reward_after": after["eval_reward"],
            "heldout_exact_before": before.get(EXACT), "heldout_exact_after": after.get(EXACT),
            "sampled_reward_first": statistics.fmean(sampled[:WINDOW]),
            "sampled_reward_last": statistics.fmean(sampled[-WINDOW:]), "sampled_reward": sampled,
            "seconds": seconds, "train_seconds": summary.get("seconds"), "threads": threads,
            "date": date.today().isoformat()}


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def print_table(results: dict) -> None:
    cells = list(results["cells"].values())
    print(f"{'method':11s} {'steps':>5s} {'n':>2s}  {'held-out reward before':24s} {'after':24s} "
          f"{'exact match before':20s} {'after':20s} {'sampled first 5':16s} {'last 5':16s} {'run s (median)':>14s}")
    for method, steps in sorted({(c["method"], c["steps"]) for c in cells}):
        mine = [c for c in cells if (c["method"], c["steps"]) == (method, steps)]

        def col(key):
            return spread([c[key] for c in mine if c[key] is not None] or [float("nan")])

        print(f"{method:11s} {steps:5d} {len(mine):2d}  {col('heldout_reward_before'):24s} "
              f"{col('heldout_reward_after'):24s} {col('heldout_exact_before'):20s} {col('heldout_exact_after'):20s} "
              f"{col('sampled_reward_first'):16s} {col('sampled_reward_last'):16s} "
              f"{statistics.median(c['seconds'] for c in mine):14.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="rloo,online_dpo", help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--seeds", default="42,11,7")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run (the configs' own: 40)")
    ap.add_argument("--threads", type=int, default=None, help="OMP threads per run (default: torch's)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--work", type=Path, default=Path("outputs/bench-rl"), help="the runs' output directories")
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    unknown = [m for m in args.methods.split(",") if m not in CONFIGS]
    if unknown:
        raise SystemExit(f"--methods {','.join(unknown)}: known methods are {', '.join(CONFIGS)}")
    if args.steps < WINDOW:
        raise SystemExit(f"--steps {args.steps}: at least {WINDOW} (the sampled reward is compared over "
                         f"the first and last {WINDOW} steps)")
    results = load_results(args.out)
    if args.table_only:
        print_table(results)
        return
    results["meta"].setdefault("runs", []).append({"date": date.today().isoformat(), "argv": sys.argv[1:],
                                                   **machine()})
    for seed in (int(s) for s in args.seeds.split(",")):
        for method in args.methods.split(","):
            key = f"{method}|{seed}|{args.steps}"
            if key in results["cells"]:
                continue
            print(f"-- {key} ...", flush=True)
            cell = run_cell(method, seed, args.steps, args.work, args.threads)
            results["cells"][key] = cell
            save_results(args.out, results)
            print(f"   held-out reward {cell['heldout_reward_before']:.3f} -> {cell['heldout_reward_after']:.3f}, "
                  f"sampled {cell['sampled_reward_first']:.3f} -> {cell['sampled_reward_last']:.3f} "
                  f"({cell['seconds']:.0f} s)", flush=True)
    save_results(args.out, results)
    print_table(results)


if __name__ == "__main__":
    main()
