"""Peak memory and step time at the sizes people train: mudpuppy vs TRL + PEFT on random Llama models.

    python benchmarks/memory_scale.py                                  # 0.5b and 1b, every run, 2 steps
    python benchmarks/memory_scale.py --sizes 1b --runs lora,qlora_int4,trl --repeat 3 --json out.json
    python benchmarks/memory_scale.py --sizes 0.5b --runs lora,trl --steps 2 --repeat 1   # the quick check

Models. Random Llama-architecture models built from a config (no download),
with SmolLM2-135M-Instruct's tokenizer and chat template (the copy mudpuppy
ships), tied embeddings, stored as bf16 safetensors, seeded with
torch.manual_seed(0); built once and reused from --models-dir:

    0.5b  hidden 1536, 16 layers, 24 heads,  4 KV heads, intermediate  4096   (~0.5B params, ~1 GB)
    1b    hidden 2048, 22 layers, 32 heads,  4 KV heads, intermediate  5632   (~1.07B params, ~2.1 GB)
    8b    hidden 4096, 32 layers, 32 heads,  8 KV heads, intermediate 14336   (GPU only; ~7.4B params, ~15 GB)

0.5b and 1b are built as transformers builds them (LlamaForCausalLM(config),
then cast to bf16): the same weights as the 1b model of issue 10. The
8b-shaped model is never materialized: its tensors are drawn shard by shard
directly in bf16 (normal(0, 0.02), norms 1) and written as ~2 GB safetensors
shards, so building it needs about one shard of host memory. Like
Llama-3-8B it does not tie its embeddings; its vocabulary is the tokenizer's.

Data and settings, the same for every run: the first 64 records of
configs/data/smart_home_train.jsonl in file order (shuffling off on both
sides, so every run trains the same batches), loss on the assistant answer,
--steps optimizer steps (default 2), micro batch 4, sequence_len / max_length
256, gradient checkpointing on, no evaluation, no progress bar.

Runs, each in its own fresh interpreter:

    lora          mudpuppy run, adapter lora r=16 alpha=32, all linear layers
    qlora_int4    mudpuppy run, adapter qlora (quant_backend int4, group 64), r=16 alpha=32
    qlora_mxfp4   mudpuppy run, adapter qlora (quant_backend mxfp4), r=16 alpha=32
    full          mudpuppy run, adapter none (full fine-tuning); 0.5b only
    trl           TRL SFTTrainer + PEFT LoRA r=16 alpha=32 all-linear, model loaded in bf16

The mudpuppy runs are `mudpuppy run --config X --overwrite` (the CLI's click
entry point called in the child, so the child can also read the GPU
allocator's peak afterwards) on a config written to --out/configs/, with
every other key at mudpuppy's default (model.dtype auto, training.precision
auto); `--mudpuppy-set KEY=VALUE` passes extra `--set` overrides. TRL
loads the model in bf16 (as issue 10 specifies; `--trl-dtype fp32` loads it
in fp32 instead) and sets bf16=True where the device has native bf16 (a GPU
that supports it, or a CPU with AVX512-BF16/AMX per mudpuppy's
cpu_has_fast_bf16); elsewhere bf16=False, which leaves the base in its
loaded dtype and the LoRA weights in fp32 (PEFT's default).

Caveat on a CPU without native bf16 (AVX2 only): TRL's bf16 base then runs
its matmuls in emulated bf16, several times slower than fp32, while mudpuppy
computes in fp32 there. Its peak memory is the fair reference (the same
bf16 weights), but its step time is not: the step-time ratio to TRL then
measures the missing bf16 hardware more than either trainer. For a speed
reference on such a CPU, add a run with `--trl-dtype fp32` (its memory is
then that of an fp32 model).

What is measured:

- peak memory: on a CPU, the whole child process's peak RSS, read by the
  parent from os.wait4 on that child (what `/usr/bin/time -v` reports; any
  processes the child waited for are included). On a GPU,
  torch.cuda.max_memory_allocated() in the child after training (host peak
  RSS is kept in the JSON too).
- step time: mudpuppy's per-step rows in output_dir/metrics.jsonl (the
  step's real tokens and tokens/s, timed around trainer.step, which excludes
  batch collation); for TRL a TrainerCallback timing on_step_begin ->
  on_step_end (batches are prefetched before on_step_begin) and counting
  non-padding tokens (include_num_input_tokens_seen="non_padding"). The step
  time is the median over steps, leaving out the first when there are more
  than 2 (it pays one-off warm-up); tokens/s is those steps' real tokens over
  their time.
- with --repeat N every run is repeated N times (round robin, so slow drift
  of the machine spreads over all runs): the table shows the median and the
  min-max spread; ratios are of the medians.

Environment: children inherit this process's environment unchanged except
TOKENIZERS_PARALLELISM=false (which the mudpuppy CLI also sets). No
MALLOC_ARENA_MAX or thread settings are injected: glibc's arena count changes
RSS, and setting it here would hide memory a user's run pays. Set it in the
shell to study its effect; it then applies to every run alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from sft_cpu import DATA, load_records, trl_prompt_completion  # noqa: E402  (light: no torch at import)

SIZES = {
    "0.5b": {"hidden_size": 1536, "num_hidden_layers": 16, "num_attention_heads": 24, "num_key_value_heads": 4,
             "intermediate_size": 4096, "tie_word_embeddings": True, "gpu_only": False},
    "1b": {"hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
           "intermediate_size": 5632, "tie_word_embeddings": True, "gpu_only": False},
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "tie_word_embeddings": False, "gpu_only": True},
}
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "tie_word_embeddings")
RUNS = ("lora", "qlora_int4", "qlora_mxfp4", "full", "trl")
FULL_SIZES = ("0.5b",)
SETTINGS = {"records": 64, "micro_batch": 4, "sequence_len": 256, "r": 16, "alpha": 32, "seed": 42, "lr": 2e-4}
SHARD_BYTES = 2 * 1024**3


# --------------------------------------------------------------------------- models

def model_dir(models_dir: Path, size: str) -> Path:
    return models_dir / f"llama-{size}"


def existing_model(path: Path, size: str) -> bool:
    """True when `path` holds a complete model of this shape; an error when it holds another."""
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        return False
    cfg = json.loads(cfg_file.read_text())
    want = {k: SIZES[size][k] for k in SHAPE_KEYS}
    got = {k: cfg.get(k) for k in SHAPE_KEYS}
    if got != want:
        sys.exit(f"{path} holds a model of another shape ({got}); expected {want}. Remove it or use another "
                 "--models-dir.")
    weights = (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists()
    return weights and (path / "tokenizer.json").exists()


def build_model(size: str, out: Path) -> None:
    """Child: write the random `size` model to `out` (a fresh directory)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from mudpuppy.backends.models import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct").path))
    spec = {k: v for k, v in SIZES[size].items() if k != "gpu_only"}
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048, rope_theta=100000.0,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      **spec)
    cfg.dtype = torch.bfloat16
    torch.manual_seed(0)
    if SIZES[size]["gpu_only"]:
        write_random_checkpoint(cfg, out)
    else:
        with torch.device("cpu"):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def write_random_checkpoint(cfg, out: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """Random bf16 weights for `cfg`, shard by shard: the model itself only ever exists on the meta device."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaForCausalLM

    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    tensors = [(name, tuple(t.shape)) for name, t in meta.state_dict().items()]
    if cfg.tie_word_embeddings:
        tensors = [(n, s) for n, s in tensors if n != "lm_head.weight"]
    del meta
    shards, current, current_bytes = [], [], 0
    for name, shape in tensors:
        nbytes = 2 * int(torch.Size(shape).numel())
        if current and current_bytes + nbytes > shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append((name, shape))
        current_bytes += nbytes
    shards.append(current)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        data = {}
        for name, shape in shard:
            if len(shape) == 1:          # RMSNorm weights
                data[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                data[name] = torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, cfg.initializer_range,
                                                                               generator=gen)
            weight_map[name] = fname
            total += data[name].numel() * 2
        save_file(data, str(out / fname), metadata={"format": "pt"})
        del data
        print(f"  wrote {fname}", flush=True)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    cfg.save_pretrained(str(out))
    GenerationConfig.from_model_config(cfg).save_pretrained(str(out))


def ensure_model(size: str, models_dir: Path) -> Path:
    path = model_dir(models_dir, size)
    if existing_model(path, size):
        print(f"model {size}: reusing {path}", flush=True)
        return path
    if path.exists() and any(path.iterdir()):
        sys.exit(f"{path} exists but holds no complete model; remove it and run again")
    models_dir.mkdir(parents=True, exist_ok=True)
    partial = models_dir / f".llama-{size}.partial-{os.getpid()}"
    print(f"model {size}: building into {path} ...", flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--child", "build", "--size", size, "--result", str(partial)],
                   check=True, env=child_env())
    if path.exists():
        path.rmdir()
    partial.rename(path)               # complete or absent, never half written
    print(f"model {size}: built in {time.perf_counter() - start:.0f} s", flush=True)
    return path


# --------------------------------------------------------------------------- runs

def mudpuppy_config(run: str, model: Path, steps: int, out: Path, backend: str) -> dict:
    adapter = {"lora": {"type": "lora"}, "qlora_int4": {"type": "qlora", "quant_backend": "int4"},
               "qlora_mxfp4": {"type": "qlora", "quant_backend": "mxfp4"}, "full": {"type": "none"}}[run]
    if adapter["type"] != "none":
        adapter.update(r=SETTINGS["r"], alpha=SETTINGS["alpha"], target_modules="all-linear")
    return {
        "model": {"base_model": str(model)},
        "backend": backend,
        "adapter": adapter,
        "data": {"datasets": [{"path": str(DATA), "num_samples": SETTINGS["records"]}],
                 "sequence_len": SETTINGS["sequence_len"], "shuffle": False, "cache": False},
        "training": {"max_steps": steps, "micro_batch_size": SETTINGS["micro_batch"], "gradient_checkpointing": True,
                     "learning_rate": SETTINGS["lr"], "seed": SETTINGS["seed"]},
        "eval": {"before_training": False, "after_training": False},
        "output_dir": str(out),
        "logging": {"progress_bar": False, "log_every": 1},
    }


def own_peaks() -> dict:
    """This process's peak RSS (MB) and, where CUDA was used, the allocator's peak (MB)."""
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024.0 * (1024 if sys.platform == "darwin" else 1))
    peaks = {"self_peak_rss_mb": rss, "cuda_peak_mb": None}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        peaks["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return peaks


def child_mudpuppy(config: Path, sets: list[str], result: Path) -> None:
    from mudpuppy.cli import main

    argv = ["run", "--config", str(config), "--overwrite"] + [a for s in sets for a in ("--set", s)]
    code = 0
    try:
        main(args=argv, prog_name="mudpuppy")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    import yaml

    out = Path(yaml.safe_load(config.read_text())["output_dir"])
    steps = []
    if (out / "metrics.jsonl").exists():
        for line in (out / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if "tokens_per_second" in row and row.get("tokens"):
                steps.append({"seconds": row["tokens"] / row["tokens_per_second"], "tokens": row["tokens"]})
    result.write_text(json.dumps({"exit": code, "steps": steps, **own_peaks()}))
    sys.exit(code)


def native_bf16(gpu: bool) -> bool:
    """Whether this device computes bf16 natively (decided in the parent: the children import only what they run)."""
    if gpu:
        # mudpuppy's own decision (the GPU's architecture), not torch.cuda.is_bf16_supported(), which ROCm
        # answers True on every card, emulated bf16 included: both sides then train at the same precision.
        from mudpuppy import create_backend
        from mudpuppy.backends.torch.devices.gpu import torch_build

        return create_backend(torch_build()).plan.precision == "bf16"
    from mudpuppy.backends.torch.devices.cpu import cpu_has_fast_bf16

    return cpu_has_fast_bf16()


def child_trl(model: Path, steps: int, out: Path, result: Path, dtype: str, bf16: bool) -> None:
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    gpu = torch.cuda.is_available()

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.steps, self.t0, self.seen = [], 0.0, 0

        def on_step_begin(self, args, state, control, **kw):
            if gpu:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if gpu:
                torch.cuda.synchronize()
            self.steps.append({"seconds": time.perf_counter() - self.t0,
                               "tokens": state.num_input_tokens_seen - self.seen})
            self.seen = state.num_input_tokens_seen

    tok = AutoTokenizer.from_pretrained(str(model))
    net = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    ds = trl_prompt_completion(load_records(SETTINGS["records"]))
    args = SFTConfig(
        output_dir=str(out), per_device_train_batch_size=SETTINGS["micro_batch"], max_steps=steps,
        learning_rate=SETTINGS["lr"], lr_scheduler_type="cosine", logging_steps=1, bf16=bf16, use_cpu=not gpu,
        gradient_checkpointing=True, report_to=[], save_strategy="no", eval_strategy="no",
        max_length=SETTINGS["sequence_len"], seed=SETTINGS["seed"], dataloader_num_workers=0, disable_tqdm=True,
        train_sampling_strategy="sequential", include_num_input_tokens_seen="non_padding",
    )
    peft = LoraConfig(r=SETTINGS["r"], lora_alpha=SETTINGS["alpha"], lora_dropout=0.0,
                      target_modules="all-linear", task_type="CAUSAL_LM")
    timer = StepTimer()
    trainer = SFTTrainer(model=net, args=args, train_dataset=ds, processing_class=tok, peft_config=peft,
                         callbacks=[timer])
    trainer.train()
    result.write_text(json.dumps({"exit": 0, "steps": timer.steps, "bf16": bf16, "dtype": dtype, **own_peaks()}))


def child_env() -> dict:
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def spawn(cmd: list[str], log: Path) -> tuple[int, float]:
    """Run `cmd`, its output to `log`; exit code and the child's peak RSS in MB (from wait4, as time -v)."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=child_env())
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    rss_mb = usage.ru_maxrss / (1024.0 * (1024 if sys.platform == "darwin" else 1))
    return proc.returncode, rss_mb


def one_run(size: str, run: str, rep: int, model: Path, args, backend: str) -> dict:
    tag = f"{size}-{run}-{rep}"
    out = args.out / "runs" / tag
    result = args.out / "results" / f"{tag}.json"
    log = args.out / "logs" / f"{tag}.log"
    for d in (result.parent, log.parent, args.out / "configs"):
        d.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    if run == "trl":
        cmd = [sys.executable, __file__, "--child", "trl", "--model", str(model), "--steps", str(args.steps),
               "--run-dir", str(out), "--result", str(result), "--trl-dtype", args.trl_dtype,
               "--trl-bf16", str(int(args.trl_bf16))]
    else:
        import yaml

        config = args.out / "configs" / f"{size}-{run}.yaml"
        config.write_text(yaml.safe_dump(mudpuppy_config(run, model, args.steps, out, backend), sort_keys=False))
        cmd = [sys.executable, __file__, "--child", "mudpuppy", "--config", str(config), "--result", str(result)]
        cmd += [a for s in args.mudpuppy_set for a in ("--mudpuppy-set", s)]
    print(f"  {tag} ...", end="", flush=True)
    start = time.perf_counter()
    code, rss_mb = spawn(cmd, log)
    wall = time.perf_counter() - start
    row = {"size": size, "run": run, "repeat": rep, "exit": code, "wall_s": wall, "peak_rss_mb": rss_mb,
           "log": str(log)}
    if result.exists():
        row.update({k: v for k, v in json.loads(result.read_text()).items() if k != "exit"})
    if code != 0 or not row.get("steps"):
        tail = log.read_text().splitlines()[-25:] if log.exists() else []
        print(f" FAILED (exit {code}); last lines of {log}:\n    " + "\n    ".join(tail), flush=True)
        row["exit"] = code or 1
        return row
    row.update(summarise_steps(row["steps"]))
    print(f" {rss_mb / 1024:.2f} GB peak RSS, {row['step_s']:.2f} s/step, {row['tokens_per_s']:.1f} tok/s, "
          f"{wall:.0f} s wall", flush=True)
    return row


def summarise_steps(steps: list[dict]) -> dict:
    counted = steps[1:] if len(steps) > 2 else steps
    seconds = sum(s["seconds"] for s in counted)
    return {"step_s": statistics.median(s["seconds"] for s in counted),
            "tokens_per_s": sum(s["tokens"] for s in counted) / seconds if seconds else 0.0,
            "steps_counted": len(counted)}


# --------------------------------------------------------------------------- report

def spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def report(rows: list[dict], gpu: bool, steps: int, repeat: int, trl_dtype: str) -> str:
    mem_key = "cuda_peak_mb" if gpu else "peak_rss_mb"
    mem_name = "peak GPU memory (max_memory_allocated)" if gpu else "peak RSS"
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r["exit"] == 0 and r.get("steps") and r.get(mem_key) is not None:
            groups.setdefault((r["size"], r["run"]), []).append(r)
    med = {k: {"mem": statistics.median(r[mem_key] for r in v), "step": statistics.median(r["step_s"] for r in v)}
           for k, v in groups.items()}
    lines = [f"{steps} steps, micro batch {SETTINGS['micro_batch']}, sequence_len {SETTINGS['sequence_len']}, "
             f"gradient checkpointing, {SETTINGS['records']} records; "
             + (f"median (min–max) of {repeat} repeats" if repeat > 1 else "one run each")
             + f"; TRL loads the model in {trl_dtype}",
             "",
             f"| size | run | {mem_name} | step time | tokens/s | memory / TRL | step time / TRL | QLoRA / LoRA step |",
             "|---|---|---|---|---|---|---|---|"]
    for (size, run), rs in groups.items():
        trl, lora, m = med.get((size, "trl")), med.get((size, "lora")), med[(size, run)]
        mem_ratio = f"{m['mem'] / trl['mem']:.2f}" if trl and run != "trl" else ""
        step_ratio = f"{m['step'] / trl['step']:.2f}" if trl and run != "trl" else ""
        q_ratio = f"{m['step'] / lora['step']:.2f}" if lora and run.startswith("qlora") else ""
        lines.append(f"| {size} | {run} | {spread([r[mem_key] / 1024 for r in rs], '{:.2f}')} GB "
                     f"| {spread([r['step_s'] for r in rs], '{:.2f}')} s "
                     f"| {spread([r['tokens_per_s'] for r in rs], '{:.1f}')} "
                     f"| {mem_ratio} | {step_ratio} | {q_ratio} |")
    failed = [r for r in rows if r["exit"] != 0 or not r.get("steps")]
    if failed:
        lines += ["", "failed: " + ", ".join(f"{r['size']}/{r['run']}#{r['repeat']} (exit {r['exit']}, {r['log']})"
                                              for r in failed)]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main

def parse_list(text: str, allowed, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        sys.exit(f"--{what}: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(allowed)}")
    return items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=None, help="comma list of 0.5b,1b,8b (default 0.5b,1b, plus 8b on a GPU)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {','.join(RUNS)} (default all)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--models-dir", type=Path, default=Path("~/.cache/mudpuppy-bench/models").expanduser())
    ap.add_argument("--out", type=Path, default=Path("outputs/bench-memory-scale"))
    ap.add_argument("--json", type=Path, help="write the raw per-run results here")
    ap.add_argument("--backend", default="auto", help="mudpuppy backend for its runs (default auto)")
    ap.add_argument("--trl-dtype", choices=["bf16", "fp32"], default="bf16",
                    help="dtype TRL loads the model in (default bf16; see the caveat above)")
    ap.add_argument("--mudpuppy-set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra `mudpuppy run --set` override for every mudpuppy run (repeatable)")
    # child modes
    ap.add_argument("--child", choices=["build", "mudpuppy", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--size", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--trl-bf16", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child == "build":
        return build_model(args.size, args.result)
    if args.child == "mudpuppy":
        return child_mudpuppy(args.config, args.mudpuppy_set, args.result)
    if args.child == "trl":
        return child_trl(args.model, args.steps, args.run_dir, args.result, args.trl_dtype, bool(args.trl_bf16))

    if args.steps < 1 or args.repeat < 1:
        sys.exit("--steps and --repeat must be at least 1")
    import torch

    gpu = torch.cuda.is_available()
    sizes = parse_list(args.sizes or ("0.5b,1b,8b" if gpu else "0.5b,1b"), SIZES, "sizes")
    runs = parse_list(args.runs, RUNS, "runs")
    if not gpu and any(SIZES[s]["gpu_only"] for s in sizes):
        sys.exit("--sizes: 8b runs only on a GPU (its bf16 weights alone are 15 GB)")
    device = torch.cuda.get_device_name(0) if gpu else f"cpu, {torch.get_num_threads()} threads"
    args.trl_bf16 = native_bf16(gpu)
    print(f"device: {device}; peak memory = {'torch.cuda.max_memory_allocated' if gpu else 'whole-process peak RSS'}")
    print(f"TRL: model loaded in {args.trl_dtype}, bf16={args.trl_bf16} "
          f"({'native' if args.trl_bf16 else 'no native'} bf16 on this device)")
    args.out.mkdir(parents=True, exist_ok=True)
    models = {s: ensure_model(s, args.models_dir) for s in sizes}
    plan = [(s, r) for s in sizes for r in runs if r != "full" or s in FULL_SIZES]
    skipped = [f"{s}/full" for s in sizes if "full" in runs and s not in FULL_SIZES]
    if skipped:
        print(f"full fine-tuning runs on {', '.join(FULL_SIZES)} only; skipping {', '.join(skipped)}")
    rows = []
    for rep in range(1, args.repeat + 1):
        print(f"repeat {rep}/{args.repeat}", flush=True)
        for size, run in plan:
            rows.append(one_run(size, run, rep, models[size], args, args.backend))
    table = report(rows, gpu, args.steps, args.repeat, args.trl_dtype)
    print()
    print(f"device: {device}")
    print(table)
    print(f"\ncommand: python benchmarks/memory_scale.py {' '.join(sys.argv[1:])}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": device, "gpu": gpu, "steps": args.steps, "repeat": args.repeat,
                                         "settings": SETTINGS, "sizes": {s: SIZES[s] for s in sizes},
                                         "rows": rows}, indent=2))
        print(f"raw results: {args.json}")
    if any(r["exit"] != 0 for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
