"""Each rank's peak memory under `--nproc 2` as the data grows: one token store per machine, shared by the ranks.

    .venv/bin/python benchmarks/shared_store.py --sizes 2000,20000,200000

For each size a seeded generator writes chats (40 words asked, 60 answered;
with the tiny test tokenizer longer than `sequence_len` 256, so every example
fills a row) to a JSONL file; then `mudpuppy run --nproc 2` trains the tiny
test model (tests/conftest.py, built once) for 5 LoRA steps on it, uncached:
rank 0 tokenizes into <cache_dir>/.scratch with 2 workers, rank 1 waits and
maps the same files (data/shared.py). Every 50 ms the launcher's descendants
are read from /proc (psutil): a rank's peak RSS is the largest seen for any
process carrying its RANK, its forked tokenizer workers included. The peer is
the smallest size: the table gives each rank's growth over it. Pages of the
store a rank has touched count in its RSS although the page cache holds them
once for both.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
WORDS = "the a light kitchen turn on off set timer music play volume door lock".split()


def write_chats(path: Path, n: int) -> None:
    rng = random.Random(n)
    with open(path, "w") as f:
        for _ in range(n):
            msgs = [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(40))},
                    {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(60))}]
            f.write(json.dumps({"messages": msgs}) + "\n")


def run_config(work: Path, model: Path, data: Path, n: int) -> Path:
    cfg = {"model": {"base_model": str(model)}, "backend": "cpu", "method": "sft",
           "adapter": {"type": "lora", "r": 4, "alpha": 8},
           "data": {"datasets": [{"path": str(data)}], "sequence_len": 256, "cache": False,
                    "cache_dir": str(work / "cache"), "num_proc": 2},
           "training": {"max_steps": 5, "micro_batch_size": 2, "precision": "fp32"},
           "eval": {"before_training": False, "after_training": False},
           "output_dir": str(work / f"out-{n}"), "logging": {"progress_bar": False}}
    path = work / f"run-{n}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def peak_per_rank(command: list[str]) -> tuple[dict[str, int], int, str]:
    """({RANK: peak RSS in bytes}, exit code, output) of a launcher and its descendants."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    peaks: dict[str, int] = {}
    launcher = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            children = launcher.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        for child in children:
            try:
                rank = child.environ().get("RANK")
                if rank is not None and "mudpuppy" in " ".join(child.cmdline()):
                    peaks[rank] = max(peaks.get(rank, 0), child.memory_info().rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        time.sleep(0.05)
    return peaks, proc.returncode, proc.stdout.read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2000,20000,200000")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from tests.conftest import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="shared-store-"))
    model = build_tiny_model(work / "model")
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        data = work / f"chats-{n}.jsonl"
        write_chats(data, n)
        started = time.perf_counter()
        command = [sys.executable, "-m", "mudpuppy", "run", "-c", str(run_config(work, model, data, n)), "--nproc", "2"]
        peaks, code, output = peak_per_rank(command)
        if code != 0:
            sys.exit(f"{n} examples: the run failed ({code}):\n{output[-3000:]}")
        shared = [line for line in output.splitlines() if line.startswith("token store:")]
        rows.append((n, {r: v / 2**20 for r, v in sorted(peaks.items())}, time.perf_counter() - started, shared))
    base = rows[0][1]
    print(f"| examples | rank 0 peak RSS | rank 1 peak RSS | growth over {rows[0][0]} (rank 0, rank 1) | wall |")
    print("|---|---|---|---|---|")
    for n, peaks, wall, shared in rows:
        growth = ", ".join(f"{peaks[r] - base[r]:+.0f} MiB" for r in sorted(peaks))
        print(f"| {n:,} | {peaks['0']:.0f} MiB | {peaks['1']:.0f} MiB | {growth} | {wall:.0f} s |")
    print("\n".join(sorted({s for row in rows for s in row[3]})))


if __name__ == "__main__":
    main()
