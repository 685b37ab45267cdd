"""N processes against one at the same global batch, on the real SmolLM2-135M-Instruct.

    python benchmarks/distributed_parity.py                    # ddp and fsdp, 2 processes, 10 steps
    python benchmarks/distributed_parity.py --steps 20 --nproc 2 --strategies fsdp
    python benchmarks/distributed_parity.py --backend cuda --nproc 4   # on a machine with 4 GPUs

Runs the quickstart's LoRA (configs/quickstart.yaml: r=16 on every linear
layer, no dropout) for --steps steps: once in one process at micro batch
N*b, then with `mudpuppy run --nproc N` at micro batch b per process for
each strategy. Prints, per strategy, the largest per-step loss difference,
the largest difference in any trained adapter weight, and each run's wall
time. On a CPU the processes share the cores (each gets cores/N threads),
so the time says what the launch and the collectives cost, not a speed-up;
on GPUs each process has its own device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

REPO = Path(__file__).resolve().parents[1]


def run(out: Path, backend: str, micro: int, steps: int, nproc: int, strategy: str, precision: str) -> float:
    command = [sys.executable, "-m", "mudpuppy", "run", "-c", str(REPO / "configs" / "quickstart.yaml"),
               "--backend", backend,
               "--set", f"output_dir={out}", "--set", f"training.max_steps={steps}",
               "--set", f"training.micro_batch_size={micro}", "--set", f"training.precision={precision}",
               "--set", "eval.before_training=false", "--set", "eval.after_training=false",
               "--set", "logging.progress_bar=false", "--set", f"distributed.strategy={strategy}"]
    if nproc > 1:
        command += ["--nproc", str(nproc)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def losses(out: Path) -> np.ndarray:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return np.array([r["loss"] for r in rows if "loss" in r])


def weight_gap(a: Path, b: Path) -> float:
    wa, wb = load_file(str(a / "adapter_model.safetensors")), load_file(str(b / "adapter_model.safetensors"))
    return max(float(np.abs(wa[k].astype(np.float64) - wb[k]).max()) for k in wa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--micro", type=int, default=4, help="micro batch per process")
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--precision", default="fp32", help="fp32 for parity; bf16 to see mixed precision")
    parser.add_argument("--strategies", default="ddp,fsdp")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mudpuppy-parity-"))
    one = tmp / "one"
    seconds = run(one, args.backend, args.micro * args.nproc, args.steps, 1, "ddp", args.precision)
    print(f"one process, micro batch {args.micro * args.nproc}: {seconds:.1f} s, final loss {losses(one)[-1]:.4f}")
    for strategy in args.strategies.split(","):
        out = tmp / strategy
        seconds = run(out, args.backend, args.micro, args.steps, args.nproc, strategy, args.precision)
        gap = np.abs(losses(out) - losses(one))
        print(f"{strategy}, {args.nproc} processes x micro batch {args.micro}: {seconds:.1f} s; "
              f"max |loss - one process| {gap.max():.2e} over {len(gap)} steps; "
              f"max |adapter weight difference| {weight_gap(one, out):.2e}")


if __name__ == "__main__":
    main()
