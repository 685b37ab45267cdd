"""Data at size: `mudpuppy preprocess` against `datasets` + `apply_chat_template`, side by side.

    .venv/bin/python benchmarks/data_scale.py --sizes 10000,100000,1000000 --runs 3 \
        [--datasets-one-process-max 100000] [--num-proc 2] [--out results/data_scale.json]

For each size a seeded generator writes chats of realistic length (a system
prompt, a question and an answer of about 200 SmolLM2 tokens together) to a
JSONL file; then, each in its own process, one after the other:

- mudpuppy: `mudpuppy preprocess` on a config naming that file (the data cache
  in a fresh folder, so it tokenizes: the token store is written to disk);
- datasets, one process and `num_proc` processes: `load_dataset("json")`, then
  `map(apply_chat_template, batched=True)` on the same tokenizer (its Arrow
  cache in a fresh folder: written to disk too). It makes no loss masks, which
  mudpuppy does (the prefixes around each assistant turn rendered too), so it
  does less work.

Then a 5-step LoRA run (`mudpuppy run`, SmolLM2-135M-Instruct, micro batch 2,
one torch thread) trains on the store the preprocess side wrote (its cache
entry, reused: the run maps it): its peak RSS and median step time (from
metrics.jsonl's `elapsed`, the first step left out) at each size, which must
not grow with the data. `--datasets-one-process-max N` skips the `datasets`
one-process side above N examples (the slowest side at 1M); the output says
which were skipped. Ratios: mudpuppy's examples/s over `datasets`
num_proc's, and each size's peak RSS and step time over the smallest size's.

With `--runs N` every side runs N times at each size (fresh caches each time)
and a summary gives the median examples/s with its min and max. Peak RSS is
the child's `ru_maxrss` (RUSAGE_CHILDREN): the largest single process of that
side, its workers included, not their sum. Examples/s is records over the
child's wall time, start-up (imports, tokenizer) included. CPU seconds are the
child's and its workers' user + system time: what the work cost whatever else
the cores were running, beside the 1-minute load average around each side.
The tokenizer is SmolLM2-135M-Instruct's (`smollm2-135m-instruct`, cached by
mudpuppy). Run it on a quiet machine, or say what else was running.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
WORDS = ("the a light door lock kitchen garage window thermostat schedule evening morning please turn set "
         "check open close warm cool degrees minutes later tomorrow front back upstairs downstairs sensor battery "
         "camera motion alert notify music volume play pause skip timer alarm reminder groceries list add remove "
         "bread milk coffee weather forecast rain sunny wind calendar meeting call message family guest").split()


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def write_chats(path: Path, count: int, seed: int = 0) -> None:
    """`count` chats of about 200 tokens: a system line, a question, a three-to-five sentence answer."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            answer = " ".join(sentence(rng, rng.randint(14, 26)) for _ in range(rng.randint(3, 5)))
            messages = [{"role": "system", "content": "You run the house. Answer in full sentences."},
                        {"role": "user", "content": sentence(rng, rng.randint(8, 20)).rstrip(".") + "?"},
                        {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages}) + "\n")


DATASETS_SIDE = """
import sys, time
from datasets import load_dataset
from transformers import AutoTokenizer
path, model, cache, num_proc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tok = AutoTokenizer.from_pretrained(model)
ds = load_dataset("json", data_files=path, split="train", cache_dir=cache)
ds = ds.map(lambda b: {"input_ids": tok.apply_chat_template(b["messages"], tokenize=True, return_dict=False)},
            batched=True, num_proc=None if num_proc == 1 else num_proc, remove_columns=["messages"])
print(len(ds), sum(len(x) for x in ds["input_ids"][:1000]))
"""


def run_child(argv: list[str], env: dict | None = None) -> dict:
    """Wall seconds and peak RSS (MB) of one child process (and its descendants' largest)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{argv[:3]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the child and every worker it waited for: what the work cost, whatever else the cores ran.
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    # ru_maxrss of children is the largest so far: a smaller child than an earlier one reads as the same.
    return {"seconds": seconds, "cpu_seconds": cpu, "peak_rss_mb": after.ru_maxrss / 1024,
            "grew": after.ru_maxrss > before.ru_maxrss, "stdout": done.stdout[-400:]}


def mudpuppy_side(data: Path, work: Path, num_proc: int) -> dict:
    import yaml

    cfg = {"model": {"base_model": "smollm2-135m-instruct"}, "method": "sft",
           "data": {"datasets": [{"path": str(data)}], "sequence_len": 1024,
                    "cache_dir": str(work / f"mp-cache-{num_proc}")},
           "output_dir": str(work / "out")}
    cfg["data"]["num_proc"] = num_proc
    path = work / f"cfg-{num_proc}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return run_child([PYTHON, "-m", "mudpuppy.cli", "preprocess", str(path), "--samples", "0"])


TRAIN_SIDE = "5-step LoRA run"


def train_config(data: Path, work: Path, num_proc: int) -> Path:
    """The preprocess side's data settings, so the run's cache key is that side's and it maps the entry
    written there (`mudpuppy preprocess` on this config says "cache: reused"), and 5 LoRA steps."""
    import yaml

    cfg = {"model": {"base_model": "smollm2-135m-instruct"}, "method": "sft", "backend": "cpu",
           "adapter": {"type": "lora", "r": 8, "alpha": 16},
           "data": {"datasets": [{"path": str(data)}], "sequence_len": 1024, "num_proc": num_proc,
                    "cache_dir": str(work / f"mp-cache-{num_proc}")},
           "training": {"max_steps": 5, "micro_batch_size": 2},
           "eval": {"before_training": False, "after_training": False},
           "output_dir": str(work / "train-out"), "logging": {"progress_bar": False}}
    path = work / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train_child(data: Path, work: Path, num_proc: int) -> dict:
    # One torch thread: two OpenMP threads on a loaded 2-core machine make step times swing several-fold.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_child([PYTHON, "-m", "mudpuppy.cli", "run", "-c", str(train_config(data, work, num_proc))], env=env)
    lines = [json.loads(x) for x in (work / "train-out" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    elapsed = [x["elapsed"] for x in lines if "loss" in x and "step" in x]
    # The first step's elapsed holds the loop's start-up: each later step is the time since the one before.
    steps = [b - a for a, b in zip(elapsed, elapsed[1:])]
    return {**result, "step_seconds": statistics.median(steps), "steps": steps}


def train_side(size: int, data: Path, work: Path, cores: int, run: int) -> dict:
    load_before = os.getloadavg()[0]
    done = subprocess.run([PYTHON, __file__, "--_child", "train", str(data), str(work), str(cores)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the training run failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    row = {"size": size, "side": TRAIN_SIDE, "run": run, **result, "load": (load_before + os.getloadavg()[0]) / 2}
    print(f"{size:>9,}  {TRAIN_SIDE:<34} {row['step_seconds']:8.2f} s/step  peak RSS {row['peak_rss_mb']:7.0f} MB  "
          f"load {row['load']:.1f}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--num-proc", type=int, default=None, help="mudpuppy's data.num_proc and datasets' "
                        "num_proc (default: the cores this process may use)")
    parser.add_argument("--runs", type=int, default=1, help="runs of every side at every size (the summary "
                        "gives the median and the spread)")
    parser.add_argument("--datasets-one-process-max", type=int, default=None, metavar="N",
                        help="skip the datasets one-process side above N examples (the slowest side at 1M)")
    parser.add_argument("--no-train", action="store_true", help="skip the 5-step LoRA run at each size")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from mudpuppy.backends.models import resolve_model

    cores = args.num_proc or len(os.sched_getaffinity(0))
    model = str(resolve_model("smollm2-135m-instruct").path)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        # Largest first would hide the smaller ones' peaks (ru_maxrss is a running maximum): each size and
        # side gets its own fresh interpreter that runs just that child.
        with tempfile.TemporaryDirectory(prefix="data-scale-", dir=ROOT / "build") as tmp:
            data = Path(tmp) / "chats.jsonl"
            write_chats(data, size)
            for run in range(args.runs):
                work = Path(tmp) / f"run{run}"        # fresh caches every run: each one tokenizes
                work.mkdir()
                skip = args.datasets_one_process_max is not None and size > args.datasets_one_process_max
                rows += run_sides(size, data, work, cores, run, skip)
                if not args.no_train:
                    rows.append(train_side(size, data, work, cores, run))
    summary = summarize(rows)
    print_tables(summary, rows, cores)
    if args.out:
        args.out.write_text(json.dumps({"model": model, "cores": cores, "runs": args.runs, "summary": summary,
                                        "rows": rows}, indent=1))


def run_sides(size: int, data: Path, work: Path, cores: int, run: int, skip_one_process: bool) -> list[dict]:
    sides = {"mudpuppy preprocess, 1 process": ("mudpuppy", 1), f"mudpuppy preprocess, num_proc={cores}": ("mudpuppy", cores),
             "datasets map, 1 process": ("datasets", 1), f"datasets map, num_proc={cores}": ("datasets", cores)}
    if skip_one_process:
        print(f"{size:>9,}  datasets map, 1 process: skipped (--datasets-one-process-max)", flush=True)
        del sides["datasets map, 1 process"]
    rows = []
    for name, (kind, procs) in sides.items():
        load_before = os.getloadavg()[0]
        done = subprocess.run([PYTHON, __file__, "--_child", kind, str(data), str(work), str(procs)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{name} failed:\n{done.stderr[-4000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        # The 1-minute load average before and after: what else the cores were running meanwhile.
        row = {"size": size, "side": name, "run": run, "mb": data.stat().st_size / 1e6, **result,
               "examples_per_s": size / result["seconds"], "load": (load_before + os.getloadavg()[0]) / 2}
        row["cpu_ms_per_example"] = 1000 * result["cpu_seconds"] / size
        rows.append(row)
        print(f"{size:>9,}  {name:<34} {row['seconds']:8.1f} s  {row['examples_per_s']:8.0f} ex/s  "
              f"{row['cpu_seconds']:7.1f} CPU s  peak RSS {row['peak_rss_mb']:7.0f} MB  load {row['load']:.1f}",
              flush=True)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per size and side: the median examples/s (the training run: seconds per step) with its min and max,
    median CPU seconds, largest peak RSS."""
    out = []
    for key in dict.fromkeys((r["size"], r["side"]) for r in rows):
        mine = [r for r in rows if (r["size"], r["side"]) == key]
        rates = [r["step_seconds" if key[1] == TRAIN_SIDE else "examples_per_s"] for r in mine]
        out.append({"size": key[0], "side": key[1], "runs": len(mine), "median": statistics.median(rates),
                    "min": min(rates), "max": max(rates),
                    "cpu_seconds": statistics.median(r["cpu_seconds"] for r in mine),
                    "cpu_ms_per_example": statistics.median(r["cpu_seconds"] * 1000 / r["size"] for r in mine),
                    "peak_rss_mb": max(r["peak_rss_mb"] for r in mine),
                    "load": statistics.median(r["load"] for r in mine)})
    return out


def print_tables(summary: list[dict], rows: list[dict], cores: int) -> None:
    """The medians as a Markdown table to paste, and the ratios the targets are stated in."""
    print("\nmedian over runs (spread: min-max); load: the 1-minute load average around each side\n")
    print("| examples | side | examples/s (training: s/step) | CPU ms per example | peak RSS | load |")
    print("|---|---|---|---|---|---|")
    for s in summary:
        rate = (f"{s['median']:.2f} s/step ({s['min']:.2f}-{s['max']:.2f})" if s["side"] == TRAIN_SIDE
                else f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})")
        cpu = "" if s["side"] == TRAIN_SIDE else f"{s['cpu_ms_per_example']:.3f}"
        print(f"| {s['size']:,} | {s['side']} | {rate} | {cpu} | {s['peak_rss_mb']:,.0f} MB | {s['load']:.1f} |")
    skipped = sorted({r["size"] for r in rows} - {s["size"] for s in summary if s["side"] == "datasets map, 1 process"})
    if skipped:
        print(f"\ndatasets map, 1 process: skipped at {', '.join(f'{n:,}' for n in skipped)} "
              "(--datasets-one-process-max)")
    by = {(s["size"], s["side"]): s for s in summary}
    sizes = sorted({s["size"] for s in summary})
    print("\nratios")
    for side in (f"mudpuppy preprocess, num_proc={cores}", TRAIN_SIDE):
        base = by.get((sizes[0], side))
        for n in sizes:
            mine, peer = by.get((n, side)), by.get((n, f"datasets map, num_proc={cores}"))
            if mine is None or base is None:
                continue
            parts = [f"peak RSS {mine['peak_rss_mb'] - base['peak_rss_mb']:+.0f} MB over {sizes[0]:,}"]
            if side == TRAIN_SIDE:
                parts.append(f"step time {mine['median'] / base['median']:.2f}x the {sizes[0]:,} one")
            elif peer is not None:
                parts.append(f"{mine['median'] / peer['median']:.2f}x datasets num_proc={cores}'s examples/s, "
                             f"{mine['cpu_ms_per_example'] / peer['cpu_ms_per_example']:.2f}x its CPU per example")
            print(f"{n:>9,}  {side}: " + "; ".join(parts))


def child() -> None:
    """One side in a fresh interpreter: its own RUSAGE_CHILDREN starts at zero."""
    kind, data, work, procs = sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])
    sys.path.insert(0, str(ROOT))
    if kind == "mudpuppy":
        result = mudpuppy_side(data, work, procs)
    elif kind == "train":
        result = train_child(data, work, procs)
    else:
        from mudpuppy.backends.models import resolve_model

        model = str(resolve_model("smollm2-135m-instruct").path)
        cache = tempfile.mkdtemp(dir=work)
        result = run_child([PYTHON, "-c", DATASETS_SIDE, str(data), model, cache, str(procs)])
    print(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_child":
        child()
    else:
        main()
