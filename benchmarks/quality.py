"""Held-out quality over seeds: mudpuppy vs TRL SFTTrainer + PEFT, same model, data, settings and seeds.

    python benchmarks/quality.py                                   # the full grid (long on a CPU)
    python benchmarks/quality.py --tasks smart_home --precision auto --seeds 42,11,7,3,99
    python benchmarks/quality.py --table-only                      # print the table of what --out holds
    # plain LoRA against each adapter.init and LoRA+ (docs/methods.md, "Measured: LoRA initialisations"):
    python benchmarks/quality.py --compare inits --tasks tickets --precision auto --seeds 42,11,7 --steps 20

Each cell (task, side, precision, seed) trains in its own process, then a
second process evaluates the adapter with plain transformers + PEFT (no
mudpuppy code is imported there): greedy exact match of the assistant answer
and the mean loss over the answer tokens (the answer and <|im_end|>) of the
held-out chats, in fp32, for both sides alike. A QLoRA cell (adapter.type qlora, LoftQ's included) is
evaluated as it trained: the training worker merges its adapter into mudpuppy's dequantized 4-bit base
(`mudpuppy merge`) and the evaluator reads that plain model with transformers alone; an adapter put on
the full-precision base instead would add LoftQ's correction of the quantization error to weights that
have none. Every cell is appended to
--out as it finishes; a rerun skips the cells already there, so a long grid
can be stopped and continued.

Settings on both sides: SmolLM2-135M-Instruct (embedded), LoRA r=16 alpha=32
on all linear layers, no dropout, lr 1e-3 with cosine decay and 5 warmup
steps, micro batch 8, no accumulation, max_grad_norm 1.0, AdamW (0.9, 0.999,
no weight decay), a fixed number of steps per task (the quickstart: 60, one
epoch; tickets: 100, two epochs), loss on the answer only. Precision `auto`:
TRL trains in bf16 autocast (bf16=True) where this CPU has native bf16 (as
benchmarks/sft_cpu.py decides), else fp32; mudpuppy gets `precision: auto`
and the precision it resolved to is recorded. `fp32` forces fp32 on both.

Tasks:
  smart_home  configs/data/smart_home_{train,val}.jsonl (480/120; the quickstart's data; its
              validation shares templates with training, see docs/benchmarks.md)
  tickets     configs/data/tickets_{train,val}.jsonl (400/100, built by configs/data/make_tickets.py;
              held-out templates never occur in training)

Variants: --compare inits runs mudpuppy alone with each LoRA start (adapter.init) and LoRA+ as its own tag,
seeds outermost; a variant this mudpuppy's load_config refuses is skipped with its reason; --only picks
some, --variant NAME:key=value[,key=value] adds one of your own.

Ablations: --tag NAME with --mp-set key=value (a mudpuppy config override,
dotted) and/or --trl-set key=value (an SFTConfig field) runs the grid with one
setting changed and files its cells under that tag, so the base cells stay
comparable. `--mp-set _patch=old_warmup` gives mudpuppy its warmup from before
issue 31 (update 0 at lr/warmup; mudpuppy now warms up as transformers does,
update 0 at lr 0), from this script, without touching mudpuppy. Cells tagged
hf_warmup were run before that change with the opposite patch: the same
schedule mudpuppy now has by default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_cpu import native_precision, peak_rss_mb, trl_prompt_completion  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "configs" / "data"
TASKS = {
    "smart_home": {"train": DATA / "smart_home_train.jsonl", "val": DATA / "smart_home_val.jsonl", "steps": 60},
    "tickets": {"train": DATA / "tickets_train.jsonl", "val": DATA / "tickets_val.jsonl", "steps": 100},
}
SETTINGS = {"r": 16, "alpha": 32, "lr": 1e-3, "warmup": 5, "batch": 8, "max_len": 256, "max_grad_norm": 1.0}
SIDES = ("mudpuppy", "trl")
DEFAULT_OUT = REPO / "benchmarks" / "results" / f"quality-{date.today().isoformat()}.json"
# --compare NAME: mudpuppy variants run side by side, each under its own tag (its name) with its overrides.
# A variant this mudpuppy refuses (load_config) is skipped with the reason, so the list can name what is
# still being built.
COMPARISONS = {
    "inits": {
        "lora": (),
        "gaussian": ("adapter.init=gaussian",),
        "pissa": ("adapter.init=pissa",),
        "pissa_niter_4": ("adapter.init=pissa_niter_4",),
        "olora": ("adapter.init=olora",),
        "eva": ("adapter.init=eva",),
        "loraplus": ("training.loraplus_lr_ratio=16",),
        # LoftQ starts from a 4-bit base's quantization error: compared with QLoRA on that base, not with LoRA.
        "qlora": ("adapter.type=qlora",),
        "loftq": ("adapter.type=qlora", "adapter.init=loftq"),
    },
}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def parse_sets(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def model_path() -> str:
    # The embedded model's directory, as sft_cpu.py finds it; the evaluator must not import mudpuppy, so
    # the training worker looks the path up and hands it over on the command line.
    from mudpuppy.backends.models import resolve_model

    return str(resolve_model("smollm2-135m-instruct").path)


# ---------------------------------------------------------------- training workers (one process each)

def train_trl(task: dict, steps: int, seed: int, precision: str, out: Path, sets: dict) -> dict:
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    path = model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ds = trl_prompt_completion(read_jsonl(task["train"]))
    kwargs = dict(
        output_dir=str(out), per_device_train_batch_size=SETTINGS["batch"], gradient_accumulation_steps=1,
        max_steps=steps, learning_rate=SETTINGS["lr"], lr_scheduler_type="cosine", warmup_steps=SETTINGS["warmup"],
        max_grad_norm=SETTINGS["max_grad_norm"], weight_decay=0.0, logging_steps=1, bf16=precision == "bf16",
        use_cpu=True, gradient_checkpointing=False, report_to=[], save_strategy="no", max_length=SETTINGS["max_len"],
        seed=seed, dataloader_num_workers=0, disable_tqdm=True,
    )
    kwargs.update(sets)
    peft = LoraConfig(r=SETTINGS["r"], lora_alpha=SETTINGS["alpha"], lora_dropout=0.0,
                      target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=SFTConfig(**kwargs), train_dataset=ds, processing_class=tok,
                         peft_config=peft)
    seconds = trainer.train().metrics["train_runtime"]
    trainer.model.save_pretrained(str(out / "adapter"))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"adapter": str(out / "adapter"), "train_seconds": seconds, "losses": losses,
            "precision_ran": precision, "peak_rss_mb": peak_rss_mb(), "model_path": path}


def mudpuppy_raw(task: dict, steps: int, seed: int, precision: str, out: Path, sets: dict) -> dict:
    """The mudpuppy config of one cell, `sets` (dotted keys, `_patch` excluded) applied."""
    raw = {
        "model": {"base_model": "smollm2-135m-instruct"},
        "backend": "cpu",
        "adapter": {"type": "lora", "r": SETTINGS["r"], "alpha": SETTINGS["alpha"], "dropout": 0.0,
                    "target_modules": "all-linear"},
        "data": {"datasets": [{"path": str(task["train"])}], "sequence_len": SETTINGS["max_len"]},
        "training": {"max_steps": steps, "micro_batch_size": SETTINGS["batch"], "gradient_accumulation_steps": 1,
                     "learning_rate": SETTINGS["lr"], "lr_scheduler": "cosine", "warmup_steps": SETTINGS["warmup"],
                     "max_grad_norm": SETTINGS["max_grad_norm"], "weight_decay": 0.0, "optimizer": "adamw",
                     "seed": seed, "precision": precision, "gradient_checkpointing": False},
        "eval": {"before_training": False, "after_training": False},
        "output_dir": str(out),
        "logging": {"progress_bar": False},
    }
    for key, value in sets.items():
        if key == "_patch":
            continue
        node = raw
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return raw


def train_mudpuppy(task: dict, steps: int, seed: int, precision: str, out: Path, sets: dict) -> dict:
    from mudpuppy import create_backend, load_config, run

    patches = str(sets.get("_patch", "")).split("+")
    if "old_warmup" in patches:
        # Ablation: mudpuppy's warmup before issue 31 (update k at lr*(k+1)/warmup, so update 0 already
        # moves the weights) instead of transformers' (update 0 at lr 0), which mudpuppy now follows.
        import mudpuppy.training.loop as loop
        from mudpuppy.training.schedule import learning_rate, warmup_steps_for

        def old_learning_rate(cfg, step, total_steps):
            warmup = warmup_steps_for(cfg, total_steps)
            return cfg.learning_rate * (step + 1) / warmup if step < warmup else learning_rate(cfg, step, total_steps)

        loop.learning_rate = old_learning_rate
    cfg = load_config(mudpuppy_raw(task, steps, seed, precision, out, sets))
    start = time.perf_counter()
    result = run(cfg, create_backend("cpu"), overwrite=True, echo=lambda *_: None)
    seconds = time.perf_counter() - start
    handle = result.model
    dtype = getattr(handle, "autocast_dtype", None)
    ran = "bf16" if "bfloat16" in str(dtype) else ("fp16" if "float16" in str(dtype) else "fp32")
    trained = {"adapter": str(out), "train_seconds": seconds, "losses": list(result.losses), "precision_ran": ran,
               "peak_rss_mb": peak_rss_mb(), "model_path": model_path()}
    if cfg.adapter.type == "qlora":     # evaluated on the 4-bit base it trained on (see the module's doc)
        from mudpuppy.training.merge import merge_run

        merged = merge_run(cfg, create_backend("cpu"), str(out), str(out.with_name(out.name + "-4bit-merged")),
                           "float32", overwrite=True, echo=lambda *_: None)
        trained.update(adapter=None, model_path=str(merged))
    return trained


# ---------------------------------------------------------------- the evaluator: transformers + PEFT only

def evaluate_adapter(base_path: str, adapter: str | None, val: Path, batch: int = 20, max_new_tokens: int = 12) -> dict:
    """Held-out greedy exact match of the answer and mean loss over the answer tokens, fp32."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(base_path)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = (PeftModel.from_pretrained(model, adapter) if adapter else model).eval()
    end = "<|im_end|>"
    end_id = tok.convert_tokens_to_ids(end)
    rows = read_jsonl(val)
    prompts = [tok.apply_chat_template(r["messages"][:-1], tokenize=False, add_generation_prompt=True) for r in rows]
    answers = [r["messages"][-1]["content"] for r in rows]
    total_loss, total_tokens, hits, predictions = 0.0, 0, 0, []
    pad = tok.pad_token_id if tok.pad_token_id is not None else end_id
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            ps, ans = prompts[i:i + batch], answers[i:i + batch]
            # Loss: prompt + answer + <|im_end|>, the answer's tokens (and <|im_end|>) scored.
            seqs, labels = [], []
            for p, a in zip(ps, ans):
                p_ids = tok(p, add_special_tokens=False)["input_ids"]
                a_ids = tok(a + end, add_special_tokens=False)["input_ids"]
                seqs.append(p_ids + a_ids)
                labels.append([-100] * len(p_ids) + a_ids)
            width = max(len(s) for s in seqs)
            ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
            lab = torch.tensor([lb + [-100] * (width - len(lb)) for lb in labels])
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            target = lab[:, 1:]
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                                    ignore_index=-100, reduction="sum")
            total_loss += nll.item()
            total_tokens += int((target != -100).sum())
            # Exact match: greedy, left-padded prompts.
            enc = [tok(p, add_special_tokens=False)["input_ids"] for p in ps]
            width = max(len(e) for e in enc)
            ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=end_id, pad_token_id=pad)
            for row, a in zip(gen[:, width:], ans):
                text = tok.decode(row, skip_special_tokens=True).strip()
                predictions.append(text)
                hits += text == a
    return {"exact_match": hits / len(rows), "heldout_loss": total_loss / total_tokens, "n": len(rows),
            "answer_tokens": total_tokens, "wrong": [(p, a) for p, a in zip(predictions, answers) if p != a][:10]}


# ---------------------------------------------------------------- the driver

def cell_key(task: str, side: str, precision: str, seed: int, tag: str) -> str:
    return f"{task}|{side}|{precision}|{seed}|{tag}"


def load_results(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"meta": {}, "cells": {}}


def save_results(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(path)


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        cpu = fields.get("Model name", cpu).strip()
        flags = fields.get("Flags", "")
        cpu += f", {fields.get('CPU(s)', '?').strip()} CPUs" + (", avx512_bf16" if "avx512_bf16" in flags else "") \
            + (", amx_bf16" if "amx_bf16" in flags else "")
    except (OSError, subprocess.CalledProcessError):
        pass
    return {"cpu": cpu, "python": platform.python_version()}


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
    """NAME:key=value[,key=value...] (NAME alone: no override) as (name, overrides)."""
    name, _, sets = text.partition(":")
    overrides = tuple(x for x in sets.split(",") if x)
    bad = [x for x in overrides if "=" not in x]
    if not name or bad:
        raise SystemExit(f"--variant {text!r}: expected NAME or NAME:key=value[,key=value], e.g. "
                         f"pissa:adapter.init=pissa")
    return name, overrides


def variants_of(args) -> list[tuple[str, list[str]]]:
    """(tag, mudpuppy overrides) of each variant the driver runs: --compare's and --variant's, else --tag's."""
    chosen: list[tuple[str, tuple[str, ...]]] = []
    for name in (args.compare.split(",") if args.compare else []):
        if name not in COMPARISONS:
            raise SystemExit(f"--compare {name!r}: known comparisons are {', '.join(COMPARISONS)}")
        chosen += list(COMPARISONS[name].items())
    chosen += [parse_variant(v) for v in args.variant]
    if not chosen:
        return [(args.tag, list(args.mp_set))]
    if args.only:
        names = args.only.split(",")
        unknown = [n for n in names if n not in dict(chosen)]
        if unknown:
            raise SystemExit(f"--only {','.join(unknown)}: not among the variants ({', '.join(dict(chosen))})")
        chosen = [(n, o) for n, o in chosen if n in names]
    if "trl" in args.sides.split(","):
        raise SystemExit("--compare / --variant run mudpuppy's settings only: pass --sides mudpuppy")
    return [(name, list(args.mp_set) + list(overrides)) for name, overrides in chosen]


def refusal(task_name: str, steps: int, sets: list[str]) -> str | None:
    """Why this mudpuppy's load_config refuses the overrides on the task, or None when it accepts them."""
    from mudpuppy import ConfigError, load_config

    try:
        load_config(mudpuppy_raw(TASKS[task_name], steps, 0, "auto", Path("outputs/bench-quality/check"),
                                 parse_sets(sets)))
    except ConfigError as e:
        return " ".join(str(e).split())
    return None


def run_cell(args, task_name: str, side: str, precision: str, seed: int, native: str, tag: str,
             mp_set: list[str]) -> dict:
    task = TASKS[task_name]
    steps = args.steps or task["steps"]
    work = args.work / f"{task_name}-{side}-{precision}-{seed}-{tag}"
    work.mkdir(parents=True, exist_ok=True)
    train_json, eval_json = work / "train.json", work / "eval.json"
    # Each side's precision for `auto`: TRL takes the native one (as sft_cpu.py), mudpuppy resolves `auto` itself.
    side_precision = precision if precision != "auto" else (native if side == "trl" else "auto")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if args.threads:
        env["QUALITY_THREADS"] = str(args.threads)
        # numpy's BLAS too (LoftQ's and MLX-side SVDs): two OpenBLAS threads on two busy cores took 22-44 s
        # for one 1536x576 SVD instead of 0.7 s; LoftQ's start (210 of them) took about 18 min in a cell.
        env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = str(args.threads)
    start = time.perf_counter()
    cmd = [sys.executable, __file__, "--worker", f"train-{side}", "--task-name", task_name, "--seed", str(seed),
           "--worker-precision", side_precision, "--worker-steps", str(steps), "--worker-dir", str(work),
           "--result", str(train_json)]
    for s in mp_set if side == "mudpuppy" else args.trl_set:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, env=env)
    trained = json.loads(train_json.read_text())
    adapter = ["--worker-dir", trained["adapter"]] if trained["adapter"] else []     # none: a merged model
    subprocess.run([sys.executable, __file__, "--worker", "eval", "--task-name", task_name, *adapter,
                    "--model-path", trained["model_path"], "--result", str(eval_json)], check=True, env=env)
    ev = json.loads(eval_json.read_text())
    return {"task": task_name, "side": side, "precision": precision, "seed": seed, "tag": tag, "steps": steps,
            "precision_ran": trained["precision_ran"], "exact_match": ev["exact_match"],
            "heldout_loss": ev["heldout_loss"], "wrong": ev["wrong"], "train_seconds": trained["train_seconds"],
            "cell_seconds": time.perf_counter() - start, "losses": trained["losses"],
            "peak_rss_mb": trained["peak_rss_mb"], "sets": mp_set if side == "mudpuppy" else args.trl_set,
            "threads": args.threads, "evaluated_on": ("the 4-bit base, adapter merged" if trained["adapter"] is None
                                                      else "the fp32 base, PEFT adapter"),
            "date": date.today().isoformat()}


def stats(values: list[float]) -> str:
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.3f} ± {std:.3f} ({min(values):.3f}-{max(values):.3f})"


def print_table(results: dict, tags: list[str] | None = None) -> None:
    cells = list(results["cells"].values())
    groups = sorted({(c["task"], c["precision"], c["tag"]) for c in cells if not tags or c["tag"] in tags})
    for task, precision, tag in groups:
        mine = [c for c in cells if (c["task"], c["precision"], c["tag"]) == (task, precision, tag)]
        seeds = sorted({c["seed"] for c in mine}, key=lambda s: [c["seed"] for c in mine].index(s))
        by = {(c["side"], c["seed"]): c for c in mine}
        ran = {side: sorted({c["precision_ran"] for c in mine if c["side"] == side}) for side in SIDES}
        print(f"\n== task {task}, precision {precision} (ran: "
              + ", ".join(f"{s} {'/'.join(r) or '-'}" for s, r in ran.items()) + f"), tag {tag}, "
              f"{mine[0]['steps']} steps ==")
        print(f"{'seed':>6s} | {'mudpuppy EM':>11s} {'loss':>7s} | {'TRL EM':>7s} {'loss':>7s}")
        for seed in seeds:
            row = f"{seed:>6d} |"
            for side in SIDES:
                c = by.get((side, seed))
                row += (f" {c['exact_match']:>{11 if side == 'mudpuppy' else 7}.3f} {c['heldout_loss']:7.4f} |" if c
                        else f" {'-':>{11 if side == 'mudpuppy' else 7}s} {'-':>7s} |")
            print(row.rstrip("|"))
        means = {}
        for side in SIDES:
            em = [by[(side, s)]["exact_match"] for s in seeds if (side, s) in by]
            loss = [by[(side, s)]["heldout_loss"] for s in seeds if (side, s) in by]
            if em:
                means[side] = (statistics.fmean(em), statistics.fmean(loss))
                secs = statistics.median(by[(side, s)]["cell_seconds"] for s in seeds if (side, s) in by)
                print(f"  {side:9s} n={len(em)}  EM mean ± std (min-max) {stats(em)}   loss {stats(loss)}"
                      f"   median cell {secs:.0f} s")
        if len(means) == 2:
            d_em = means["mudpuppy"][0] - means["trl"][0]
            d_loss = means["mudpuppy"][1] - means["trl"][1]
            print(f"  difference of means mudpuppy - TRL: EM {d_em:+.3f}   loss {d_loss:+.4f}")


def print_comparison(results: dict, tags: list[str]) -> None:
    """One row per variant (tag): held-out exact match and loss over its seeds, and its times."""
    cells = [c for c in results["cells"].values() if c["tag"] in tags and c["side"] == "mudpuppy"]
    for task, precision, steps in sorted({(c["task"], c["precision"], c["steps"]) for c in cells}):
        print(f"\n== task {task}, precision {precision}, {steps} steps, mudpuppy ==")
        print(f"{'variant':14s} {'n':>2s}  {'exact match mean ± std (min-max)':34s} {'held-out loss':>13s} "
              f"{'train s (median)':>16s} {'cell s':>7s}")
        for tag in tags:
            mine = [c for c in cells if (c["task"], c["precision"], c["steps"], c["tag"]) == (task, precision, steps, tag)]
            if not mine:
                continue
            em = [c["exact_match"] for c in mine]
            loss = statistics.fmean(c["heldout_loss"] for c in mine)
            print(f"{tag:14s} {len(mine):2d}  {stats(em):34s} {loss:13.4f} "
                  f"{statistics.median(c['train_seconds'] for c in mine):16.0f} "
                  f"{statistics.median(c['cell_seconds'] for c in mine):7.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="42,11,7,3,99")
    ap.add_argument("--precision", default="auto,fp32", help="comma list of auto, fp32")
    ap.add_argument("--tasks", default="smart_home,tickets")
    ap.add_argument("--sides", default=None, help="mudpuppy,trl (default; with --compare/--variant: mudpuppy)")
    ap.add_argument("--steps", type=int, default=None, help="override each task's step count")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--work", type=Path, default=Path("outputs/bench-quality"), help="adapters and per-cell files")
    ap.add_argument("--tag", default="base", help="name of an ablation (cells are keyed by it)")
    ap.add_argument("--mp-set", action="append", default=[], help="mudpuppy config override key=value (dotted)")
    ap.add_argument("--trl-set", action="append", default=[], help="SFTConfig override key=value")
    ap.add_argument("--compare", default=None,
                    help=f"comma list of variant sets to run side by side on mudpuppy: {', '.join(COMPARISONS)} "
                         f"(inits: {', '.join(COMPARISONS['inits'])}); each variant is a tag")
    ap.add_argument("--variant", action="append", default=[],
                    help="a variant of your own, NAME:key=value[,key=value] (mudpuppy overrides; NAME is its tag)")
    ap.add_argument("--only", default=None, help="comma list: run only these of --compare's variants")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per worker (default: torch's). 1 is faster on a 2-core machine that "
                         "something else is also using: two threads then wait on each other at every matmul")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--show-tags", default=None, help="comma list of tags to print (default: all)")
    # worker plumbing
    ap.add_argument("--worker", choices=["train-mudpuppy", "train-trl", "eval"], help=argparse.SUPPRESS)
    ap.add_argument("--task-name", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker-precision", help=argparse.SUPPRESS)
    ap.add_argument("--worker-steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    ap.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker and os.environ.get("QUALITY_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["QUALITY_THREADS"]))
    if args.worker == "eval":
        r = evaluate_adapter(args.model_path, str(args.worker_dir) if args.worker_dir else None,
                             TASKS[args.task_name]["val"])
        args.result.write_text(json.dumps(r))
        return
    if args.worker:
        fn = train_trl if args.worker == "train-trl" else train_mudpuppy
        r = fn(TASKS[args.task_name], args.worker_steps, args.seed, args.worker_precision, args.worker_dir,
               parse_sets(args.set))
        args.result.write_text(json.dumps(r))
        return

    args.sides = args.sides or ("mudpuppy" if args.compare or args.variant else "mudpuppy,trl")
    results = load_results(args.out)
    variants = variants_of(args)
    if args.table_only:
        if args.compare or args.variant:
            print_comparison(results, [tag for tag, _ in variants])
        else:
            print_table(results, args.show_tags.split(",") if args.show_tags else None)
        return
    native, why = native_precision()
    results["meta"].setdefault("runs", []).append({
        "date": date.today().isoformat(), "argv": sys.argv[1:], **machine(),
        "auto_means": f"TRL {native} ({why}); mudpuppy resolves precision: auto itself (see precision_ran)"})
    print(f"precision auto: TRL {native} ({why}); mudpuppy: its own `auto` (recorded per cell)", flush=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    compared = bool(args.compare or args.variant)
    for task in args.tasks.split(","):
        runnable = variants
        if compared:
            steps = args.steps or TASKS[task]["steps"]
            why = {tag: refusal(task, steps, sets) for tag, sets in variants}
            for tag, reason in why.items():
                if reason:
                    print(f"-- variant {tag} skipped: mudpuppy refuses it ({reason})", flush=True)
            runnable = [(tag, sets) for tag, sets in variants if not why[tag]]
        for precision in args.precision.split(","):
            # Seeds outermost: a stopped comparison has every variant at the same number of seeds.
            for seed in seeds:
                for tag, sets in runnable:
                    for side in args.sides.split(","):
                        key = cell_key(task, side, precision, seed, tag)
                        if key in results["cells"]:
                            continue
                        print(f"-- {key} ...", flush=True)
                        cell = run_cell(args, task, side, precision, seed, native, tag, sets)
                        results["cells"][key] = cell
                        save_results(args.out, results)
                        print(f"   exact match {cell['exact_match']:.3f}  held-out loss {cell['heldout_loss']:.4f}  "
                              f"({cell['precision_ran']}, train {cell['train_seconds']:.0f} s, cell "
                              f"{cell['cell_seconds']:.0f} s)", flush=True)
    save_results(args.out, results)
    if compared:
        print_comparison(results, [tag for tag, _ in variants])
    else:
        print_table(results, [args.tag])


if __name__ == "__main__":
    main()
