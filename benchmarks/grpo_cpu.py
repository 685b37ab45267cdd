"""TRL GRPOTrainer + PEFT LoRA vs mudpuppy GRPO on SmolLM2-135M-Instruct, alternated on this machine.

    nice -n 5 python benchmarks/grpo_cpu.py --threads 1             # 3 pairs, 1 warm-up + 8 timed steps each
    python benchmarks/grpo_cpu.py --threads 1 --repeat 1 --steps 2   # a quick look
    python benchmarks/grpo_cpu.py --table-only --out benchmarks/results/grpo_cpu-2026-11-26.json
    python benchmarks/grpo_cpu.py --threads 1 --profile mudpuppy --steps 3   # cProfile (no value: both sides)

The full run took 19 minutes on the project's 2-core machine; results go to
--out (default benchmarks/results/grpo_cpu-<date>.json), rewritten after
every run, and --table-only prints the table of such a file.

Both sides: the embedded SmolLM2-135M-Instruct, the prompts of
configs/data/arithmetic_rl_train.jsonl rendered with the chat template (TRL
gets them as user messages, mudpuppy's `auto` prompt style renders them the
same), the reward benchmarks/grpo_reward.py:sum_reward (deterministic, no
model; both sides import the same function), and configs/grpo.yaml's
settings: LoRA r=16 alpha=32 on all linear layers, no dropout; lr 2e-4
constant, AdamW, no weight decay, max_grad_norm 1.0; num_generations 8,
max_completion_length 32, temperature 0.7, top_p 1, top_k 0; beta 0 (no
reference), loss_type dapo, scale_rewards group, one pass per generation
(num_iterations 1); 8 completions a micro-batch (TRL's
per_device_train_batch_size counts completions, as mudpuppy's
micro_batch_size does) and 2 accumulation steps, so steps_per_generation
defaults to 2 on both sides and each optimizer step samples one generation
batch of 16 completions (2 prompts x 8) in one `generate` call; no gradient
checkpointing (TRL's default would turn it on), no evaluation, no
checkpoints, no completions log, no progress bar, seed 42. Precision: the
one native to this CPU, as benchmarks/sft_cpu.py decides (bf16 autocast
where oneDNN reports AVX512-BF16/AMX, else fp32), the same on both sides.

Each run is its own process (peak RSS is its own: ru_maxrss, model load
included), with --threads torch threads (and OMP_NUM_THREADS). Runs
alternate mudpuppy, TRL, mudpuppy, TRL, ... (--repeat pairs); the summary
gives medians and (min-max).

Timing: the first --warmup-steps optimizer steps are run but not timed.
A step's seconds are wall time from the end of the previous step to the end
of this one, generation included: TRL from a callback's on_step_end
timestamps, mudpuppy from metrics.jsonl's `elapsed` (written at the end of
each step). Generation time: TRL's `_generate_single_turn` (the
`model.generate` call, its padding and the cut at EOS) timed by wrapping it;
mudpuppy's `time/generation` (`backend.sample`: the same `model.generate`).
Generation tokens/s is completion tokens kept (up to and including the stop
token) over that time; `generate` also runs finished rows until the batch's
longest ends, so it does more work than the count says, alike on both sides.

The two sides sample different completions (their RNG streams and prompt
orders differ), so completions can differ in length: the table gives each
side's mean completion length and the seconds per 1,000 completion tokens,
the fairer speed comparison when the lengths differ.
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
from quality import save_results  # noqa: E402
from sft_cpu import announce_precision, peak_rss_mb  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "configs" / "data" / "arithmetic_rl_train.jsonl"
REWARD = Path(__file__).resolve().parent / "grpo_reward.py"
SETTINGS = {"r": 16, "alpha": 32, "lr": 2e-4, "num_generations": 8, "max_completion_length": 32,
            "temperature": 0.7, "micro_batch": 8, "grad_accum": 2, "beta": 0.0, "loss_type": "dapo",
            "scale_rewards": "group", "max_grad_norm": 1.0, "seed": 42, "prompt_len": 128}
SIDES = ("mudpuppy", "trl")
DEFAULT_OUT = REPO / "benchmarks" / "results" / f"grpo_cpu-{date.today().isoformat()}.json"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def completions_per_step(s: dict) -> int:
    return s["micro_batch"] * s["grad_accum"]


# ---------------------------------------------------------------- workers (one process each)

def run_trl(s: dict, total_steps: int, precision: str, out: Path) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_reward import sum_reward
    from mudpuppy.backends.models import resolve_model

    class StepClock(TrainerCallback):
        def __init__(self):
            self.start, self.ends = None, []

        def on_train_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with its generation and its whole rollout (generate + score) timed, per optimizer step."""

        def _generate_single_turn(self, prompt_ids, *a, **kw):
            t0 = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *a, **kw)
            self.clock_gen.append({"step": self.state.global_step, "seconds": time.perf_counter() - t0,
                                   "tokens": sum(len(c) for c in completion_ids), "n": len(completion_ids)})
            return completion_ids, logprobs

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.clock_rollout.append({"step": self.state.global_step, "seconds": time.perf_counter() - t0,
                                       "reward": self._metrics["train"]["reward"][-1]})
            return out

    path = str(resolve_model("smollm2-135m-instruct").path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                            for r in read_jsonl(DATA)])
    args = GRPOConfig(
        output_dir=str(out), max_steps=total_steps, per_device_train_batch_size=s["micro_batch"],
        gradient_accumulation_steps=s["grad_accum"], num_generations=s["num_generations"],
        max_completion_length=s["max_completion_length"], temperature=s["temperature"], top_p=1.0, top_k=0,
        beta=s["beta"], loss_type=s["loss_type"], scale_rewards=s["scale_rewards"], num_iterations=1,
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=s["max_grad_norm"], seed=s["seed"], bf16=precision == "bf16", use_cpu=True,
        gradient_checkpointing=False, logging_strategy="no", report_to=[], save_strategy="no", eval_strategy="no",
        log_completions=False, disable_tqdm=True, dataloader_num_workers=0,
    )
    peft = LoraConfig(r=s["r"], lora_alpha=s["alpha"], lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    clock = StepClock()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=sum_reward, args=args, train_dataset=ds,
                               processing_class=tok, peft_config=peft, callbacks=[clock])
    trainer.clock_gen, trainer.clock_rollout = [], []
    trainer.train()
    marks = [clock.start] + clock.ends
    gen = {g["step"]: g for g in trainer.clock_gen}
    roll = {r["step"]: r for r in trainer.clock_rollout}
    return {"step_seconds": [b - a for a, b in zip(marks, marks[1:])],
            "generation_seconds": [gen[i]["seconds"] for i in range(total_steps)],
            "rollout_seconds": [roll[i]["seconds"] for i in range(total_steps)],
            "completion_tokens": [gen[i]["tokens"] for i in range(total_steps)],
            "completions": [gen[i]["n"] for i in range(total_steps)],
            "rewards": [roll[i]["reward"] for i in range(total_steps)],
            "precision_ran": precision, "peak_rss_mb": peak_rss_mb()}


def mudpuppy_config(s: dict, total_steps: int, precision: str, out: Path) -> dict:
    return {
        "model": {"base_model": "smollm2-135m-instruct"},
        "backend": "cpu",
        "method": "grpo",
        "grpo": {"num_generations": s["num_generations"], "max_completion_length": s["max_completion_length"],
                 "temperature": s["temperature"], "top_p": 1.0, "top_k": 0, "beta": s["beta"],
                 "loss_type": s["loss_type"], "scale_rewards": s["scale_rewards"], "num_iterations": 1,
                 "reward_funcs": [f"{REWARD}:sum_reward"], "log_completions": False},
        "adapter": {"type": "lora", "r": s["r"], "alpha": s["alpha"], "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"datasets": [{"path": str(DATA)}], "sequence_len": s["prompt_len"]},
        "training": {"max_steps": total_steps, "micro_batch_size": s["micro_batch"],
                     "gradient_accumulation_steps": s["grad_accum"], "learning_rate": s["lr"],
                     "lr_scheduler": "constant", "warmup_steps": 0, "weight_decay": 0.0, "optimizer": "adamw",
                     "max_grad_norm": s["max_grad_norm"], "seed": s["seed"], "precision": precision,
                     "gradient_checkpointing": False},
        "eval": {"before_training": False, "after_training": False},
        "output_dir": str(out),
        "logging": {"progress_bar": False, "log_every": 1},
    }


def run_mudpuppy(s: dict, total_steps: int, precision: str, out: Path) -> dict:
    from mudpuppy import create_backend, load_config, run

    cfg = load_config(mudpuppy_config(s, total_steps, precision, out))
    result = run(cfg, create_backend("cpu"), overwrite=True, echo=lambda *_: None)
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "step" in r]
    elapsed = [0.0] + [r["elapsed"] for r in rows]       # MetricsLog's clock starts as the loop does
    n = completions_per_step(s)
    dtype = str(getattr(result.model, "autocast_dtype", None))
    return {"step_seconds": [b - a for a, b in zip(elapsed, elapsed[1:])],
            "generation_seconds": [r["time/generation"] for r in rows],
            "rollout_seconds": [r["time/generation"] + r["time/scoring"] for r in rows],
            "completion_tokens": [round(r["completions/mean_length"] * n) for r in rows],
            "completions": [n for _ in rows],
            "rewards": [r["reward"] for r in rows],
            "precision_ran": "bf16" if "bfloat16" in dtype else "fp32", "peak_rss_mb": peak_rss_mb()}


def worker(side: str, s: dict, total_steps: int, precision: str, out: Path, threads: int | None) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    fn = run_trl if side == "trl" else run_mudpuppy
    result = fn(s, total_steps, precision, out)
    return {**result, "threads": torch.get_num_threads()}


def profile_worker(side: str, s: dict, total_steps: int, precision: str, out: Path, threads: int | None) -> None:
    """One run under cProfile: the stats go to out/profile.prof, the top functions to stdout."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    worker(side, s, total_steps, precision, out, threads)
    prof.disable()
    out.mkdir(parents=True, exist_ok=True)
    prof.dump_stats(str(out / "profile.prof"))
    stats = pstats.Stats(prof).strip_dirs()
    print(f"\n== {side}: cProfile, {total_steps} steps, model load included; by own time ==")
    stats.sort_stats("tottime").print_stats(20)
    print(f"== {side}: by cumulative time ==")
    stats.sort_stats("cumulative").print_stats(35)


# ---------------------------------------------------------------- summaries

def summarize(r: dict, warmup: int) -> dict:
    """The timed steps (after the warm-up) of one run."""
    step = r["step_seconds"][warmup:]
    gen, roll = r["generation_seconds"][warmup:], r["rollout_seconds"][warmup:]
    tokens, n = r["completion_tokens"][warmup:], r["completions"][warmup:]
    total = sum(step)
    return {"s_per_step": total / len(step), "gen_tok_s": sum(tokens) / sum(gen), "gen_share": sum(gen) / total,
            "rollout_share": sum(roll) / total, "train_s_per_step": (total - sum(roll)) / len(step),
            "mean_len": sum(tokens) / sum(n), "s_per_1k": total / (sum(tokens) / 1000.0),
            "peak_rss_mb": r["peak_rss_mb"], "reward": statistics.fmean(r["rewards"][warmup:])}


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """Median, and (min-max) when there is more than one value."""
    med = fmt.format(statistics.median(values))
    return med if len(values) == 1 else f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"


COLUMNS = [("s/step", "s_per_step", "{:.2f}"), ("train s/step", "train_s_per_step", "{:.2f}"),
           ("gen tok/s", "gen_tok_s", "{:.0f}"),
           ("gen share", "gen_share", "{:.0%}"), ("mean len", "mean_len", "{:.1f}"),
           ("s/1k compl tok", "s_per_1k", "{:.2f}"), ("peak RSS MB", "peak_rss_mb", "{:.0f}"),
           ("reward", "reward", "{:.2f}")]


def print_table(results: dict) -> None:
    meta, runs = results["meta"], results["runs"]
    warmup, steps = meta["warmup_steps"], meta["steps"]
    s = meta["settings"]
    by = {side: [summarize(r, warmup) for r in runs if r["side"] == side] for side in SIDES}
    pairs = sorted({r["pair"] for r in runs})
    print(f"\nGRPO on {meta['cpu']}, {meta['threads'] or 'default'} torch thread(s) a side; precision "
          f"{meta['precision']} ({meta['precision_why']}); {warmup} warm-up + {steps} timed optimizer steps, "
          f"{completions_per_step(s)} completions a step ({completions_per_step(s) // s['num_generations']} prompts x "
          f"{s['num_generations']}), max_completion_length {s['max_completion_length']}; "
          f"median (min-max) of {len(pairs)} run(s) a side")
    cells = {side: {c: spread([x[k] for x in by[side]], f) for c, k, f in COLUMNS} for side in SIDES if by[side]}
    width = {c: max([len(c)] + [len(row[c]) for row in cells.values()]) for c, _, _ in COLUMNS}
    print(f"{'':9s} " + "  ".join(f"{c:>{width[c]}s}" for c, _, _ in COLUMNS))
    for side, row in cells.items():
        print(f"{side:9s} " + "  ".join(f"{row[c]:>{width[c]}s}" for c, _, _ in COLUMNS))
    paired = [(m, t) for p in pairs
              for m in [summarize(r, warmup) for r in runs if r["pair"] == p and r["side"] == "mudpuppy"]
              for t in [summarize(r, warmup) for r in runs if r["pair"] == p and r["side"] == "trl"]]
    if paired:
        speed = [t["s_per_step"] / m["s_per_step"] for m, t in paired]
        norm = [t["s_per_1k"] / m["s_per_1k"] for m, t in paired]
        rss = [m["peak_rss_mb"] / t["peak_rss_mb"] for m, t in paired]
        train = [t["train_s_per_step"] / m["train_s_per_step"] for m, t in paired]
        print(f"\nmudpuppy/TRL, median (min-max) over the pairs: steps/s {spread(speed)}x; per 1k completion tokens "
              f"{spread(norm)}x (the fairer one: completion lengths differ between sides); peak RSS {spread(rss)}x; "
              f"train s/step (the step less its rollout) {spread(train)}x")
    print("  s/step: wall time of an optimizer step, generation included; gen tok/s: completion tokens kept (to the "
          "stop token) / seconds in generate; gen share: generate's share of the step; train s/step: the step less "
          "its rollout (generate and scoring): forward, backward, update; s/1k compl tok: step time per 1,000 "
          "completion tokens; reward: mean sampled reward (sum_reward, max 1.5)")
    shares = {side: statistics.median(x["gen_share"] for x in by[side]) for side in SIDES if by[side]}
    if shares and max(shares.values()) >= 1 / 3:
        parts = ", ".join(f"{v:.0%} of {k}'s step" for k, v in shares.items())
        print(f"  generation is {parts}: `generate` runs a whole forward per new token for only "
              f"{completions_per_step(s)} rows, about a third of the training step's arithmetic done in small, "
              "slow pieces (16-row matmuls, one-query attention, a sampling pass over the vocabulary), until the "
              "longest row stops")


# ---------------------------------------------------------------- the driver

def machine() -> str:
    cpu = platform.processor() or ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        flags = fields.get("Flags", "")
        cpu = fields.get("Model name", cpu).strip() + f", {fields.get('CPU(s)', '?').strip()} CPUs" \
            + (", avx512_bf16" if "avx512_bf16" in flags else "") + (", amx_bf16" if "amx_bf16" in flags else "")
    except (OSError, subprocess.CalledProcessError):
        pass
    return cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="timed optimizer steps a run")
    ap.add_argument("--warmup-steps", type=int, default=1, help="optimizer steps run first and not timed")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each side, alternated; median and min-max")
    ap.add_argument("--max-completion-length", type=int, default=SETTINGS["max_completion_length"])
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="auto: bf16 where the CPU has native bf16, else fp32 (both sides alike)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per run (default: torch's). 1 is the fair choice on a 2-core machine that "
                         "something else is also using")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON (written after every run)")
    ap.add_argument("--work", type=Path, default=Path("outputs/bench-grpo-cpu"), help="the runs' output folders")
    ap.add_argument("--table-only", action="store_true", help="print the table of what --out holds")
    ap.add_argument("--profile", nargs="?", const="mudpuppy,trl", default=None, metavar="SIDES",
                    help="run each side (or the comma list given) once under cProfile; nothing goes to --out")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--worker-precision", help=argparse.SUPPRESS)
    ap.add_argument("--worker-profile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    settings = {**SETTINGS, "max_completion_length": args.max_completion_length}
    total = args.warmup_steps + args.steps

    if args.worker:
        if args.worker_profile:
            profile_worker(args.worker, settings, total, args.worker_precision, args.work, args.threads)
            return
        r = worker(args.worker, settings, total, args.worker_precision, args.work, args.threads)
        args.result.write_text(json.dumps(r))
        return
    if args.table_only:
        print_table(json.loads(args.out.read_text()))
        return
    if args.steps < 1 or args.repeat < 1 or args.warmup_steps < 0:
        sys.exit("--steps and --repeat must be at least 1, --warmup-steps at least 0")

    precision, why = announce_precision(args.precision)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    base = [sys.executable, __file__, "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
            "--max-completion-length", str(args.max_completion_length), "--worker-precision", precision] \
        + (["--threads", str(args.threads)] if args.threads else [])

    if args.profile:
        for side in args.profile.split(","):
            subprocess.run(base + ["--worker", side, "--worker-profile", "--work", str(args.work / f"profile-{side}")],
                           check=True, env=env)
        return

    results = {"meta": {"date": date.today().isoformat(), "argv": sys.argv[1:], "cpu": machine(),
                        "python": platform.python_version(), "threads": args.threads, "precision": precision,
                        "precision_why": why, "steps": args.steps, "warmup_steps": args.warmup_steps,
                        "settings": settings, "load_average_at_start": os.getloadavg()[0]},
               "runs": []}
    for pair in range(1, args.repeat + 1):
        for side in SIDES:
            run_dir = args.work / f"{side}-{pair}"
            result_file = args.work / f"{side}-{pair}.json"
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            print(f"running {side}: {args.warmup_steps} warm-up + {args.steps} timed steps "
                  f"(run {pair}/{args.repeat}) ...", flush=True)
            started = time.perf_counter()
            subprocess.run(base + ["--worker", side, "--work", str(run_dir), "--result", str(result_file)],
                           check=True, env=env)
            r = {"side": side, "pair": pair, "process_seconds": time.perf_counter() - started,
                 **json.loads(result_file.read_text())}
            results["runs"].append(r)
            save_results(args.out, results)
            x = summarize(r, args.warmup_steps)
            print(f"  {side}: {x['s_per_step']:.2f} s/step, {x['gen_tok_s']:.0f} gen tok/s, generation "
                  f"{x['gen_share']:.0%} of the step, mean completion {x['mean_len']:.1f} tokens, "
                  f"{x['s_per_1k']:.2f} s per 1k completion tokens, peak RSS {x['peak_rss_mb']:.0f} MB, "
                  f"{r['threads']} thread(s), {r['precision_ran']} ({r['process_seconds']:.0f} s in all)", flush=True)
    print_table(results)
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
