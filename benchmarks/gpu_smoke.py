"""GPU smoke benchmark: LoRA steps of mudpuppy and of TRL SFTTrainer + PEFT, on the same GPU, in one run.

    python benchmarks/gpu_smoke.py                       # 30 steps each on the first usable GPU
    python benchmarks/gpu_smoke.py --steps 60 --device 1 --json smoke.json
    python benchmarks/gpu_smoke.py --qlora               # also QLoRA (mudpuppy's adapter.type qlora, int4;
                                                         # TRL's side needs bitsandbytes)

Both sides train SmolLM2-135M-Instruct (the embedded `smollm2-135m-instruct`
alias) with LoRA r=16 on every linear layer, on configs/data/smart_home_train.jsonl,
batch 8, at the precision mudpuppy picks for the GPU (bf16, or fp16 with loss
scaling). Like for like: TRL's base is loaded in that same 16-bit dtype (the
dtype mudpuppy holds a frozen base in on a GPU), both sides use gradient
checkpointing, and `--qlora` runs mudpuppy's real `adapter.type: qlora` load
path against TRL with bitsandbytes' 4-bit NF4. Throughput counts non-padding
tokens per second over the steps after the warm-up ones; peak memory is
torch.cuda.max_memory_allocated. Loss masks differ: mudpuppy trains on the
assistant turns only, TRL's default on every token, so losses are shown but not
compared.

Not a test: without a CUDA or ROCm GPU it says so and exits with code 2.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import TrainerCallback

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "configs" / "data" / "smart_home_train.jsonl"
MODEL = "smollm2-135m-instruct"
LORA = {"r": 16, "alpha": 32, "dropout": 0.0}
NO_GPU_EXIT = 2


@dataclass
class Measurement:
    name: str
    tokens_per_second: float | None = None
    peak_gib: float | None = None
    final_loss: float | None = None
    note: str = ""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing (default 5)")
    parser.add_argument("--batch", type=int, default=8, help="examples per step (default 8)")
    parser.add_argument("--seq-len", type=int, default=256, help="longest sequence in tokens (default 256)")
    parser.add_argument("--device", type=int, default=None, help="torch GPU index (default: first usable)")
    parser.add_argument("--qlora", action="store_true", help="also run QLoRA (4-bit base weights)")
    parser.add_argument("--json", type=Path, default=None, help="write the measurements here as JSON")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps, or nothing is timed")
    return args


# ------------------------------------------------------------------- the GPU

def find_gpu_backend(device: int | None):
    """The mudpuppy backend for this torch build and GPU, or a message saying why there is none."""
    from mudpuppy import create_backend
    from mudpuppy.backends.torch.devices.gpu import describe_build, torch_build
    from mudpuppy.errors import MudpuppyError

    build = torch_build()
    if build == "cpu" or not torch.cuda.is_available():
        return None, (f"gpu_smoke: no CUDA or ROCm GPU here ({describe_build()}); this benchmark measures "
                      "GPU throughput only. Run it on a machine with a GPU.")
    try:
        return create_backend(build, devices=None if device is None else [device]), ""
    except MudpuppyError as exc:
        return None, f"gpu_smoke: the {build} backend is not usable here: {exc}"


def reset_gpu_memory(device: torch.device) -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30


def tokens_per_second(steps: list[tuple[int, float]], warmup: int) -> float:
    """Throughput over the (tokens, seconds) of each step after the warm-up ones."""
    timed = steps[warmup:]
    return sum(t for t, _ in timed) / max(sum(s for _, s in timed), 1e-9)


# ------------------------------------------------------------------ mudpuppy

def mudpuppy_config(args, backend_name: str, out_dir: Path, qlora: bool) -> dict:
    adapter = {"type": "qlora", "quant_backend": "int4"} if qlora else {"type": "lora"}
    return {
        "model": {"base_model": MODEL},
        "backend": backend_name,
        "method": "sft",
        "adapter": {**adapter, **LORA, "target_modules": "all-linear"},
        "data": {"datasets": [{"path": str(DATA)}], "sequence_len": args.seq_len},
        "training": {"max_steps": args.steps, "micro_batch_size": args.batch, "learning_rate": 1e-3,
                     "lr_scheduler": "constant", "precision": "auto", "seed": 42, "gradient_checkpointing": True},
        "eval": {"before_training": False, "after_training": False},
        "output_dir": str(out_dir),
        "logging": {"progress_bar": False, "log_every": 1},
    }


def read_step_times(out_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["tokens"], r["tokens"] / r["tokens_per_second"]) for r in rows if r.get("tokens_per_second")]


def run_mudpuppy(args, backend, qlora: bool) -> Measurement:
    import mudpuppy
    from mudpuppy.training import run

    name = "mudpuppy " + ("qlora" if qlora else "lora")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cfg = mudpuppy.load_config(mudpuppy_config(args, backend.name, out, qlora))
        reset_gpu_memory(backend.plan.device)
        result = run(cfg, backend, echo=lambda _line: None)
        steps = read_step_times(out)
    return Measurement(name, tokens_per_second(steps, args.warmup), peak_gib(backend.plan.device),
                       result.losses[-1] if result.losses else None)


# ----------------------------------------------------------------------- TRL

class StepClock(TrainerCallback):
    """Records (non-padding tokens, seconds) for every optimizer step."""

    def __init__(self):
        self.steps: list[tuple[int, float]] = []
        self.last_time = self.last_tokens = None

    def on_train_begin(self, args, state, control, **_):
        torch.cuda.synchronize()
        self.last_time, self.last_tokens = time.perf_counter(), state.num_input_tokens_seen

    def on_step_end(self, args, state, control, **_):
        torch.cuda.synchronize()  # kernels are asynchronous; time what ran, not what was queued
        now = time.perf_counter()
        self.steps.append((state.num_input_tokens_seen - self.last_tokens, now - self.last_time))
        self.last_time, self.last_tokens = now, state.num_input_tokens_seen


def trl_model(model_dir: str, precision: str, qlora: bool):
    """The base in the 16-bit dtype mudpuppy computes in (its LoRA weights stay fp32, PEFT's default)."""
    from transformers import AutoModelForCausalLM

    compute = torch.bfloat16 if precision == "bf16" else torch.float16
    if not qlora:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=compute, attn_implementation="sdpa")
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)
    return AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quant, dtype=compute,
                                                attn_implementation="sdpa")


def run_trl(args, device: torch.device, precision: str, qlora: bool) -> Measurement:
    from datasets import disable_progress_bars, load_dataset
    from mudpuppy.backends.models import resolve_model
    from peft import LoraConfig
    from transformers import AutoTokenizer, PrinterCallback
    from trl import SFTConfig, SFTTrainer

    name = "trl+peft " + ("qlora" if qlora else "lora")
    disable_progress_bars()
    if qlora and importlib.util.find_spec("bitsandbytes") is None:
        return Measurement(name, note="skipped: TRL's QLoRA needs bitsandbytes, which is not installed")
    model_dir = str(resolve_model(MODEL, None, False).path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    clock = StepClock()
    torch.cuda.set_device(device)  # before SFTConfig: it settles its device once, on first use
    with tempfile.TemporaryDirectory() as tmp:
        config = SFTConfig(
            output_dir=tmp, max_steps=args.steps, per_device_train_batch_size=args.batch, learning_rate=1e-3,
            lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], seed=42,
            bf16=precision == "bf16", fp16=precision == "fp16", max_length=args.seq_len,
            gradient_checkpointing=True, include_num_input_tokens_seen="non_padding", disable_tqdm=True,
        )
        lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                          target_modules="all-linear", task_type="CAUSAL_LM")
        reset_gpu_memory(device)
        trainer = SFTTrainer(model=trl_model(model_dir, precision, qlora), args=config, peft_config=lora,
                             train_dataset=load_dataset("json", data_files=str(DATA), split="train"),
                             processing_class=tokenizer, callbacks=[clock])
        trainer.remove_callback(PrinterCallback)  # one table at the end, not a dict per step
        trainer.train()
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    measured = Measurement(name, tokens_per_second(clock.steps, args.warmup), peak_gib(device),
                           losses[-1] if losses else None)
    del trainer
    return measured


# -------------------------------------------------------------------- report

def format_row(m: Measurement) -> str:
    def cell(value, fmt):
        return format(value, fmt) if value is not None else "-"

    row = f"{m.name:18s} {cell(m.tokens_per_second, '>10.1f')} {cell(m.peak_gib, '>9.2f')} {cell(m.final_loss, '>11.4f')}"
    return f"{row}  {m.note}".rstrip()


def ratio_line(ours: Measurement, theirs: Measurement) -> str:
    parts = []
    if ours.tokens_per_second and theirs.tokens_per_second:
        parts.append(f"{ours.tokens_per_second / theirs.tokens_per_second:.2f}x tokens/s")
    if ours.peak_gib and theirs.peak_gib:
        parts.append(f"{ours.peak_gib / theirs.peak_gib:.2f}x peak memory")
    measured = ", ".join(parts) or f"not measured ({theirs.note or ours.note or 'a run recorded nothing'})"
    return f"ratio {ours.name} / {theirs.name}: {measured}"


def main(argv=None) -> int:
    args = parse_args(argv)
    backend, problem = find_gpu_backend(args.device)
    if backend is None:
        print(problem, file=sys.stderr)
        return NO_GPU_EXIT
    plan = backend.plan
    print(f"gpu_smoke: torch {torch.__version__}, {backend.name} backend")
    for note in plan.notes:
        print(f"  {note}")
    print(f"LoRA r={LORA['r']} all-linear on {MODEL}; batch {args.batch}; sequence_len {args.seq_len}; "
          f"{args.steps} steps, the first {args.warmup} not timed; precision {plan.precision}\n")
    pairs = [(run_mudpuppy(args, backend, False), run_trl(args, plan.device, plan.precision, False))]
    if getattr(args, "qlora", False):
        pairs.append((run_mudpuppy(args, backend, True), run_trl(args, plan.device, plan.precision, True)))
    print(f"{'run':18s} {'tokens/s':>10s} {'peak GiB':>9s} {'final loss':>11s}")
    for ours, theirs in pairs:
        print(format_row(ours))
        print(format_row(theirs))
    for ours, theirs in pairs:
        print(ratio_line(ours, theirs))
    if args.json:
        args.json.write_text(json.dumps([asdict(m) for pair in pairs for m in pair], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
