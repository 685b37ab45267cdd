"""TRL SFTTrainer + PEFT LoRA vs mudpuppy on SmolLM2-135M-Instruct, back to back on this machine.

    python benchmarks/sft_cpu.py                  # one epoch of the quickstart data (60 steps)
    python benchmarks/sft_cpu.py --steps 20       # shorter

Both runs: same model (the embedded SmolLM2-135M-Instruct), same data
(configs/data/smart_home_train.jsonl, loss on the assistant answer only), same
LoRA (r=8, alpha=16, all linear layers, no dropout), same effective batch (8),
learning rate, cosine schedule and warmup, bf16 autocast, no gradient
checkpointing. Each runs in its own subprocess so peak RSS is its own. Prints
real (non-padding) tokens per second, peak RSS, the ratio mudpuppy/TRL and
both training-loss curves, then evaluates both trained adapters with one
evaluator on the held-out set (loss on the answer tokens, exact match). The
training losses are not directly comparable: TRL's completion also counts the
newline after <|im_end|>, and the two shuffle and warm up differently.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def real_tokens(tokenizer, records: list[dict]) -> int:
    """Tokens of the rendered conversations: what both trainers feed, minus padding."""
    # Render, then tokenize: transformers 5's apply_chat_template(tokenize=True) returns a dict.
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in records]
    return sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_trl(steps: int, out: Path) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from mudpuppy.backends.models import resolve_model

    path = str(resolve_model("smollm2-135m-instruct").path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    records = load_records(steps * COMMON["batch"])
    # Conversational prompt/completion: TRL puts the loss on the completion (the answer) only.
    ds = Dataset.from_list([{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in records])
    args = SFTConfig(
        output_dir=str(out), per_device_train_batch_size=COMMON["batch"], max_steps=steps,
        learning_rate=COMMON["lr"], lr_scheduler_type="cosine", warmup_steps=COMMON["warmup"],
        logging_steps=1, bf16=True, use_cpu=True, gradient_checkpointing=False, report_to=[],
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


def run_mudpuppy(steps: int, out: Path) -> dict:
    from mudpuppy import create_backend, load_config, run

    records = load_records(steps * COMMON["batch"])
    cfg = load_config({
        "model": {"base_model": "smollm2-135m-instruct"},
        "backend": "cpu",
        "adapter": {"type": "lora", "r": COMMON["r"], "alpha": COMMON["alpha"], "target_modules": "all-linear"},
        "data": {"datasets": [{"path": str(DATA), "num_samples": len(records)}], "sequence_len": COMMON["max_len"]},
        "training": {"max_steps": steps, "micro_batch_size": COMMON["batch"], "learning_rate": COMMON["lr"],
                     "lr_scheduler": "cosine", "warmup_steps": COMMON["warmup"], "seed": COMMON["seed"],
                     "precision": "bf16", "gradient_checkpointing": False},
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


def worker(which: str, steps: int, out: Path, result_file: Path) -> None:
    result = run_trl(steps, out) if which == "trl" else run_mudpuppy(steps, out)
    result_file.write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", type=Path, default=Path("outputs/bench-sft-cpu"))
    ap.add_argument("--worker", choices=["trl", "mudpuppy"], help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out / args.worker, args.result)
        return

    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for which in ("trl", "mudpuppy"):
        result_file = args.out / f"{which}.json"
        print(f"running {which} for {args.steps} steps ...", flush=True)
        subprocess.run([sys.executable, __file__, "--worker", which, "--steps", str(args.steps),
                        "--out", str(args.out), "--result", str(result_file)], check=True,
                       env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        results[which] = json.loads(result_file.read_text())

    print()
    print(f"{'':12s} {'real tok/s':>10s} {'s/step':>7s} {'peak RSS MB':>11s} {'first loss':>10s} {'last-5 loss':>11s}")
    for which, r in results.items():
        tps = r["tokens"] / r["seconds"]
        last = sum(r["losses"][-5:]) / len(r["losses"][-5:])
        print(f"{which:12s} {tps:10.0f} {r['seconds'] / args.steps:7.2f} {r['peak_rss_mb']:11.0f} "
              f"{r['losses'][0]:10.4f} {last:11.4f}")
    t, m = results["trl"], results["mudpuppy"]
    ratio = (m["tokens"] / m["seconds"]) / (t["tokens"] / t["seconds"])
    print(f"\nthroughput ratio mudpuppy/TRL: {ratio:.2f}x   peak RSS ratio: {m['peak_rss_mb'] / t['peak_rss_mb']:.2f}")

    held = evaluate_adapters({"trl": args.out / "trl" / "adapter", "mudpuppy": args.out / "mudpuppy"})
    print("\nheld-out (configs/data/smart_home_val.jsonl, 120 examples, same evaluator, fp32):")
    for which, r in held.items():
        print(f"  {which:10s} loss {r['heldout_loss']:.4f}   exact match {r['exact_match']:.1%}")
    print("\nloss curves (step: TRL / mudpuppy)")
    for i, (a, b) in enumerate(zip(t["losses"], m["losses"]), start=1):
        if i <= 5 or i % 5 == 0 or i == len(t["losses"]):
            print(f"  {i:3d}: {a:.4f} / {b:.4f}")


if __name__ == "__main__":
    main()
