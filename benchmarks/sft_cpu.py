"""TRL SFTTrainer + PEFT LoRA vs mudpuppy on SmolLM2-135M-Instruct, back to back on this machine.

    python benchmarks/sft_cpu.py                  # one epoch of the quickstart data (60 steps)
    python benchmarks/sft_cpu.py --steps 20       # shorter
    python benchmarks/sft_cpu.py --repeat 3       # each side 3 times: median and spread (min-max)

Both runs: same model (the embedded SmolLM2-135M-Instruct), same data
(configs/data/smart_home_train.jsonl, loss on the assistant answer only), same
LoRA (r=8, alpha=16, all linear layers, no dropout), same effective batch (8),
learning rate, cosine schedule and warmup, the same precision, no gradient
checkpointing. Each runs in its own subprocess so peak RSS is its own. Prints
real (non-padding) tokens per second, peak RSS, the ratio mudpuppy/TRL and
both training-loss curves, then evaluates both trained adapters with one
evaluator on the held-out set (loss on the answer tokens, exact match). The
training losses are not directly comparable: TRL's completion also counts the
newline after <|im_end|>, and the two shuffle and warm up differently.

Precision: the one native to this machine, the same for both sides. bf16
autocast (TRL: bf16=True on the fp32 model; mudpuppy: training.precision bf16)
only where the CPU runs bf16 matmuls natively (AVX512-BF16 or AMX, as
mudpuppy's `cpu_has_fast_bf16` reports from oneDNN); elsewhere, e.g. an
AVX2-only CPU, where bf16 matmuls are emulated and several times slower than
fp32, both sides train in fp32 (TRL bf16=False, mudpuppy precision fp32).
`--precision bf16|fp32` forces one for both. The precision that ran, and why,
is printed before the runs and in the summary.

With --repeat N each side runs N times, alternating TRL and mudpuppy so drift
of the machine hits both; the summary gives the median and the spread
(min-max) of real tokens/s per side and of the per-pair ratio mudpuppy/TRL.
Losses, the loss curves and the held-out evaluation are from the first pair.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "configs" / "data" / "smart_home_train.jsonl"
VAL = REPO / "configs" / "data" / "smart_home_val.jsonl"
COMMON = {"r": 8, "alpha": 16, "lr": 1e-3, "batch": 8, "warmup": 5, "seed": 42, "max_len": 256}


def load_records(limit: int) -> list[dict]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return rows[:limit]


def trl_prompt_completion(records: list[dict]):
    """Conversational prompt/completion rows: TRL puts the loss on the completion (the answer) only."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in records])


def announce_precision(choice: str) -> tuple[str, str]:
    """(the precision both sides run at, why) for `--precision` (`auto`: native_precision), printed."""
    precision, why = native_precision() if choice == "auto" else (choice, "forced with --precision")
    print(f"precision: {precision} for both TRL and mudpuppy ({why})", flush=True)
    return precision, why


def native_precision() -> tuple[str, str]:
    """bf16 where this CPU runs bf16 matmuls natively, else fp32; and why."""
    from mudpuppy.backends.torch.devices.cpu import cpu_has_fast_bf16

    if cpu_has_fast_bf16():
        return "bf16", "this CPU runs bf16 matmuls natively (oneDNN reports AVX512-BF16/AMX)"
    return "fp32", "this CPU has no native bf16 (oneDNN reports no AVX512-BF16/AMX): bf16 would be emulated, slower"


def real_tokens(tokenizer, records: list[dict]) -> int:
    """Tokens of the rendered conversations: what both trainers feed, minus padding."""
    # Render, then tokenize: transformers 5's apply_chat_template(tokenize=True) returns a dict.
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in records]
    return sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_trl(steps: int, out: Path, precision: str) -> dict:
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from mudpuppy.backends.models import resolve_model

    path = str(resolve_model("smollm2-135m-instruct").path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    records = load_records(steps * COMMON["batch"])
    ds = trl_prompt_completion(records)
    args = SFTConfig(
        output_dir=str(out), per_device_train_batch_size=COMMON["batch"], max_steps=steps,
        learning_rate=COMMON["lr"], lr_scheduler_type="cosine", warmup_steps=COMMON["warmup"],
        logging_steps=1, bf16=precision == "bf16", use_cpu=True, gradient_checkpointing=False, report_to=[],
        save_strategy="no", max_length=COMMON["max_len"], seed=COMMON["seed"], dataloader_num_workers=0,
        disable_tqdm=True,
    )
    peft = LoraConfig(r=COMMON["r"], lora_alpha=COMMON["alpha"], lora_dropout=0.0,
                      target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=peft)
    seconds = trainer.train().metrics["train_runtime"]
    trainer.model.save_pretrained(str(out / "adapter"))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"seconds": seconds, "tokens": real_tokens(tok, records), "losses": losses, "peak_rss_mb": peak_rss_mb()}


def run_mudpuppy(steps: int, out: Path, precision: str) -> dict:
    from mudpuppy import create_backend, load_config, run

    records = load_records(steps * COMMON["batch"])
    cfg = load_config({
        "model": {"base_model": "smollm2-135m-instruct"},
        "backend": "cpu",
        "adapter": {"type": "lora", "r": COMMON["r"], "alpha": COMMON["alpha"], "target_modules": "all-linear"},
        "data": {"datasets": [{"path": str(DATA), "num_samples": len(records)}], "sequence_len": COMMON["max_len"]},
        "training": {"max_steps": steps, "micro_batch_size": COMMON["batch"], "learning_rate": COMMON["lr"],
                     "lr_scheduler": "cosine", "warmup_steps": COMMON["warmup"], "seed": COMMON["seed"],
                     "precision": precision, "gradient_checkpointing": False},
        "eval": {"before_training": False, "after_training": False},
        "output_dir": str(out),
        "logging": {"progress_bar": False},
    })
    result = run(cfg, create_backend("cpu"), overwrite=True, echo=lambda *_: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    counted = sum(r["tokens"] for r in rows)          # real tokens the steps processed
    return {"seconds": counted / result.tokens_per_second, "tokens": real_tokens(result.model.tokenizer, records),
            "counted_tokens": counted, "losses": result.losses, "peak_rss_mb": peak_rss_mb()}


def evaluate_adapters(adapters: dict[str, Path]) -> dict[str, dict]:
    """Both adapters through one evaluator: held-out loss on the answer tokens and exact match."""
    from mudpuppy import create_backend, load_config
    from mudpuppy.data import load_data, prepare_sft_data
    from mudpuppy.evaluation import evaluate

    cfg = load_config({
        "model": {"base_model": "smollm2-135m-instruct"},
        "data": {"datasets": [{"path": str(VAL)}], "val_datasets": [{"path": str(VAL)}], "sequence_len": 256},
        "training": {"precision": "fp32"},
        "eval": {"exact_match": True, "max_new_tokens": 8, "batch_size": 32},
        "output_dir": "unused",
    })
    backend = create_backend("cpu", precision="fp32")
    results = {}
    for which, path in adapters.items():
        handle = backend.load_model(cfg.model, "fp32")
        backend.load_adapter(handle, str(path))
        data = prepare_sft_data(cfg, handle.tokenizer, load_data(cfg, "sft"))
        ev = evaluate(backend, handle, data, cfg.eval)
        results[which] = {"heldout_loss": ev.loss, "exact_match": ev.exact_match}
    return results


def worker(which: str, steps: int, out: Path, result_file: Path, precision: str) -> None:
    result = run_trl(steps, out, precision) if which == "trl" else run_mudpuppy(steps, out, precision)
    result_file.write_text(json.dumps({**result, "precision": precision}))


def tokens_per_second(r: dict) -> float:
    return r["tokens"] / r["seconds"]


def spread(values: list[float], fmt: str = "{:.0f}") -> str:
    """Median, and (min-max) when there is more than one value."""
    med = fmt.format(statistics.median(values))
    return med if len(values) == 1 else f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each side; the summary gives median and min-max")
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="auto: bf16 where the CPU has native bf16, else fp32 (both sides alike)")
    ap.add_argument("--out", type=Path, default=Path("outputs/bench-sft-cpu"))
    ap.add_argument("--worker", choices=["trl", "mudpuppy"], help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out, args.result, args.precision)
        return
    if args.repeat < 1 or args.steps < 1:
        sys.exit("--steps and --repeat must be at least 1")

    precision, why = announce_precision(args.precision)

    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"trl": [], "mudpuppy": []}
    for i in range(1, args.repeat + 1):
        for which in ("trl", "mudpuppy"):
            run_dir = args.out / (which if i == 1 else f"{which}-{i}")
            result_file = args.out / (f"{which}.json" if i == 1 else f"{which}-{i}.json")
            print(f"running {which} for {args.steps} steps (run {i}/{args.repeat}) ...", flush=True)
            subprocess.run([sys.executable, __file__, "--worker", which, "--steps", str(args.steps),
                            "--precision", precision, "--out", str(run_dir), "--result", str(result_file)],
                           check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            r = json.loads(result_file.read_text())
            runs[which].append(r)
            print(f"  {which}: {tokens_per_second(r):.0f} real tokens/s, {r['seconds'] / args.steps:.2f} s/step, "
                  f"peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)

    print()
    print(f"precision: {precision} ({why})")
    label = "real tok/s" if args.repeat == 1 else f"real tok/s, median (min-max) of {args.repeat}"
    width = max(len(label), 10)
    print(f"{'':12s} {label:>{width}s} {'s/step':>7s} {'peak RSS MB':>11s} {'first loss':>10s} {'last-5 loss':>11s}")
    for which, rs in runs.items():
        first = rs[0]
        last = sum(first["losses"][-5:]) / len(first["losses"][-5:])
        step_s = statistics.median(r["seconds"] / args.steps for r in rs)
        rss = statistics.median(r["peak_rss_mb"] for r in rs)
        print(f"{which:12s} {spread([tokens_per_second(r) for r in rs]):>{width}s} {step_s:7.2f} {rss:11.0f} "
              f"{first['losses'][0]:10.4f} {last:11.4f}")
    t, m = runs["trl"][0], runs["mudpuppy"][0]
    ratios = [tokens_per_second(b) / tokens_per_second(a) for a, b in zip(runs["trl"], runs["mudpuppy"])]
    rss_ratio = statistics.median(b["peak_rss_mb"] / a["peak_rss_mb"] for a, b in zip(runs["trl"], runs["mudpuppy"]))
    held = evaluate_adapters({"trl": args.out / "trl" / "adapter", "mudpuppy": args.out / "mudpuppy"})
    print(f"\nthroughput ratio mudpuppy/TRL: {spread(ratios, '{:.2f}')}x"
          + (" (median (min-max) over the run pairs)" if args.repeat > 1 else "")
          + f"   peak RSS ratio: {rss_ratio:.2f}"
          + f"   held-out exact match: mudpuppy {held['mudpuppy']['exact_match']:.1%}, TRL {held['trl']['exact_match']:.1%}")
    print("  (one seed; benchmarks/quality.py compares held-out quality over 5 seeds)")
    print("\nheld-out (configs/data/smart_home_val.jsonl, 120 examples, same evaluator, fp32"
          + (", first run of each" if args.repeat > 1 else "") + "):")
    for which, r in held.items():
        print(f"  {which:10s} loss {r['heldout_loss']:.4f}   exact match {r['exact_match']:.1%}")
    print("\nloss curves (step: TRL / mudpuppy)")
    for i, (a, b) in enumerate(zip(t["losses"], m["losses"]), start=1):
        if i <= 5 or i % 5 == 0 or i == len(t["losses"]):
            print(f"  {i:3d}: {a:.4f} / {b:.4f}")


if __name__ == "__main__":
    main()
