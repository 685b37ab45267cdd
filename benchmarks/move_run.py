"""One run moved between runtimes mid-way, against the same run left on one: SmolLM2 on the quickstart.

    python benchmarks/move_run.py                       # torch (cpu) -> mlx -> torch, 3 + 3 + 3 steps
    python benchmarks/move_run.py --route mlx,cpu --steps 4 --json move.json

The quickstart (SmolLM2-135M-Instruct, LoRA r=16 on every linear layer, micro batch 8, lr 1e-3 cosine with
5 warmup steps), at fp32 with dropout 0 and a checkpoint every leg, runs `--steps` x legs optimizer steps
twice: straight through on the first backend of the route, and moved: each leg is `mudpuppy run` on the
next backend of the route, the first from scratch, the others with `--resume` from the checkpoint the
previous leg left (the process is stopped right after that checkpoint, as a preempted job would be).
Each leg is a process of its own. Printed: every step's loss on both and their difference, where each
moved step ran, and the largest difference between the final adapters (PEFT's file, which both write).
Nothing here is random once the weights start (dropout 0, no sampling): what differs is the two runtimes'
arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))                  # tests.faults: a callback that SIGKILLs right after a step's checkpoint
from tests.faults import kill_after  # noqa: E402


def overrides(total: int, every: int, out: Path) -> list[str]:
    sets = {"training.epochs": "null", "training.max_steps": total, "training.save_steps": every,
            "training.precision": "fp32", "adapter.dropout": 0.0, "eval.before_training": "false",
            "eval.after_training": "false", "logging.progress_bar": "false", "output_dir": str(out)}
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


def leg(backend: str, total: int, every: int, out: Path, stop_after: int | None, resume: bool) -> None:
    cmd = [sys.executable, "-m", "mudpuppy", "run", "-c", str(REPO / "configs" / "quickstart.yaml"),
           "--backend", backend, *overrides(total, every, out), *(["--resume"] if resume else [])]
    env = {**os.environ, **(kill_after(stop_after) if stop_after else {})}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    killed = stop_after is not None and done.returncode == -9
    if done.returncode != 0 and not killed:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    for line in done.stderr.splitlines():
        if line.startswith("note: "):
            print(f"  {line}")


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows if "loss" in r and "eval_loss" not in r]


def adapter(out: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(out / "adapter_model.safetensors"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--route", default="cpu,mlx,cpu", help="the backends, one a leg (default cpu,mlx,cpu)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps a leg (default 3)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    route = [b.strip() for b in args.route.split(",") if b.strip()]
    total = args.steps * len(route)
    with tempfile.TemporaryDirectory(prefix="mudpuppy-move-") as tmp:
        straight, moved = Path(tmp) / "straight", Path(tmp) / "moved"
        print(f"straight: {total} steps on {route[0]}")
        leg(route[0], total, args.steps, straight, None, resume=False)
        for i, backend in enumerate(route):
            last = i == len(route) - 1
            print(f"moved, leg {i + 1}: steps {i * args.steps + 1}-{(i + 1) * args.steps} on {backend}")
            leg(backend, total, args.steps, moved, None if last else (i + 1) * args.steps, resume=i > 0)
        a, b = losses(straight), losses(moved)
        wa, wb = adapter(straight), adapter(moved)
    where = [route[(step - 1) // args.steps] for step in range(1, total + 1)]
    print(f"\n{'step':>4} {'ran on':>7} {'straight':>10} {'moved':>10} {'|diff|':>9}")
    for step, (x, y) in enumerate(zip(a, b), 1):
        print(f"{step:>4} {where[step - 1]:>7} {x:>10.6f} {y:>10.6f} {abs(x - y):>9.2e}")
    loss_diff = max(abs(x - y) for x, y in zip(a, b))
    adapter_diff = max(float(np.abs(wa[k].astype(np.float64) - wb[k]).max()) for k in wa)
    scale = max(float(np.abs(wa[k]).max()) for k in wa)
    print(f"\nlargest per-step loss difference {loss_diff:.2e}; final adapter: largest difference {adapter_diff:.2e} "
          f"(largest weight {scale:.3f})")
    if args.json:
        args.json.write_text(json.dumps({"route": route, "steps_per_leg": args.steps, "straight": a, "moved": b,
                                         "ran_on": where, "max_loss_diff": loss_diff,
                                         "max_adapter_diff": adapter_diff}, indent=2))
    return 0 if len(a) == len(b) == total else 1


if __name__ == "__main__":
    sys.exit(main())
