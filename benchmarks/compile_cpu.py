"""Eager vs `training.compile: true` (regional torch.compile) on SmolLM2-135M-Instruct, this machine.

    python benchmarks/compile_cpu.py                    # 3 rounds of eager + compiled, 14 steps each
    python benchmarks/compile_cpu.py --rounds 1 --steps 8 --modes eager,dynamic,default

Each mode runs in its own subprocess with an empty inductor cache, so the
compile time is the cold one a first run pays. All modes train the same
batches (the quickstart data, LoRA r=8 on all linear layers, micro batch 8,
fp32 unless --precision bf16) through the public backend API. Reported per mode:
the steady-state step time (median of the steps after --warmup), the time the
warm-up steps took beyond that (compile and recompiles), and the final loss,
then the median over rounds with the spread (min-max).

Modes: eager; dynamic (compile_layers, dynamic=True, what training.compile
uses); default (torch.compile's dynamic=None: static first, recompile on the
next new shape).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "configs" / "data" / "smart_home_train.jsonl"


def config(steps: int, batch: int, checkpointing: bool, precision: str) -> dict:
    return {
        "model": {"base_model": "smollm2-135m-instruct"}, "backend": "cpu", "method": "sft",
        "adapter": {"type": "lora", "r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"datasets": [{"path": str(DATA)}], "sequence_len": 256},
        "training": {"max_steps": steps, "micro_batch_size": batch, "learning_rate": 1e-3, "precision": precision,
                     "seed": 42, "gradient_checkpointing": checkpointing},
        "output_dir": tempfile.mkdtemp(),
    }


def run_mode(mode: str, steps: int, batch: int, checkpointing: bool, precision: str) -> dict:
    """One training run in this process; prints nothing, returns the timings."""
    from mudpuppy import create_backend, load_config
    from mudpuppy.backends.torch.compile import compile_layers
    from mudpuppy.data import Batcher, prepare_sft_data

    cfg = load_config(config(steps, batch, checkpointing, precision))
    backend = create_backend("cpu", precision=precision)
    backend.seed(cfg.training.seed)
    handle = backend.load_model(cfg.model, precision)
    backend.attach_adapter(handle, cfg.adapter)
    trainer = backend.create_trainer(handle, cfg.training)
    layers = 0
    if mode != "eager":
        layers = compile_layers(handle.model, dynamic=True if mode == "dynamic" else None)
    batcher = Batcher.from_config(prepare_sft_data(cfg, handle.tokenizer).train, cfg, handle.tokenizer.pad_token_id)
    times, losses, shapes = [], [], []
    for _ in range(steps):
        batch = batcher.next_batch()
        start = time.perf_counter()
        result = trainer.step([batch], cfg.training.learning_rate)
        times.append(time.perf_counter() - start)
        losses.append(result.loss)
        shapes.append(list(batch.input_ids.shape))
    return {"mode": mode, "layers": layers, "times": times, "losses": losses, "shapes": shapes}


def summarise(run: dict, warmup: int) -> dict:
    steady = statistics.median(run["times"][warmup:])
    extra = sum(run["times"][:warmup]) - warmup * steady     # what the first steps cost beyond steady state
    return {"steady_s": steady, "compile_s": extra, "loss": run["losses"][-1]}


def spawn(mode: str, args) -> dict:
    """The mode in a fresh interpreter with an empty inductor cache: a cold compile."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, HF_HUB_OFFLINE="1")
        cmd = [sys.executable, __file__, "--child", mode, "--steps", str(args.steps), "--batch", str(args.batch),
               "--precision", args.precision]
        if args.checkpointing:
            cmd.append("--checkpointing")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4, help="steps counted as compile, not steady state")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                        help="bf16 autocast only pays on CPUs with native bf16 (AVX512-BF16 / AMX)")
    parser.add_argument("--modes", default="eager,dynamic")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_mode(args.child, args.steps, args.batch, args.checkpointing, args.precision)))
        return
    modes = args.modes.split(",")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            run = spawn(mode, args)
            s = summarise(run, args.warmup)
            results[mode].append(s)
            print(f"round {r + 1} {mode:8s} steady {s['steady_s']:.3f} s/step  compile {s['compile_s']:6.1f} s  "
                  f"loss {s['loss']:.5f}  first steps {[round(t, 2) for t in run['times'][:args.warmup]]}  "
                  f"shapes {run['shapes'][:args.warmup]}", flush=True)
    print(f"\nmedian of {args.rounds} (min-max), {args.steps} steps, warm-up {args.warmup}, batch {args.batch}, "
          f"{args.precision}, checkpointing {'on' if args.checkpointing else 'off'}:")
    eager = statistics.median(s["steady_s"] for s in results.get("eager", [])) if "eager" in results else None
    for mode, rows in results.items():
        steady = [s["steady_s"] for s in rows]
        comp = [s["compile_s"] for s in rows]
        ratio = f"  {eager / statistics.median(steady):.2f}x eager's speed" if eager else ""
        print(f"  {mode:8s} steady {statistics.median(steady):.3f} s/step ({min(steady):.3f}-{max(steady):.3f})  "
              f"compile {statistics.median(comp):.1f} s ({min(comp):.1f}-{max(comp):.1f}){ratio}")


if __name__ == "__main__":
    main()
