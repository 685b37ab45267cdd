"""Runs without writing YAML: `mudpuppy train MODEL DATA --method ...` (the seed's command line) and
`mudpuppy init` (a wizard that writes a commented config).

Both build the same config dict a YAML file would hold and validate it with
`load_config`, so a bad flag gets the config's own message (naming the key
the flag sets). `train` then runs it like `mudpuppy run`, whose first act is
writing the resolved config to `output_dir/config.yaml`: the run can be
repeated with `mudpuppy run -c OUTPUT/config.yaml`.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from .errors import MudpuppyError

# The seed's --method names, and ours, onto (method, adapter type, preference type).
METHODS = {
    "full": ("sft", "none", None), "sft": ("sft", "lora", None), "lora": ("sft", "lora", None),
    "dora": ("sft", "dora", None), "qlora": ("sft", "qlora", None),
    "dpo": ("preference", "lora", "dpo"), "ipo": ("preference", "lora", "ipo"),
    "simpo": ("preference", "lora", "simpo"), "orpo": ("preference", "lora", "orpo"),
    "kto": ("preference", "lora", "kto"), "preference": ("preference", "lora", "dpo"),
    "grpo": ("grpo", "lora", None), "rl": ("grpo", "lora", None),
    "rloo": ("rloo", "lora", None), "online_dpo": ("online_dpo", "lora", None), "online-dpo": ("online_dpo", "lora", None),
    "rm": ("rm", "lora", None), "prm": ("prm", "lora", None),
    "gptq": ("gptq", "none", None), "qat": ("qat", "none", None),
}
PRECISIONS = {"auto": "auto", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8"}
MERGE_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
# The online methods on GRPO's rollouts: each has its own section, with reward functions (--reward).
ONLINE = ("grpo", "rloo", "online_dpo")


def data_path(value: str, flag: str) -> str:
    """A local data file as an absolute path (the config may be run from elsewhere); a Hub name as given."""
    path = Path(value).expanduser()
    if path.exists():
        return str(path.resolve())
    if value.count("/") == 1 and not value.startswith((".", "/", "~")) and not path.suffix:
        return value                      # owner/name on the Hub
    raise MudpuppyError(f"{flag}: {value} does not exist (a data file, or a Hub dataset as owner/name)")


def train_config(model: str, data: str, method: str = "lora", output: str = "outputs", *,
                 preference: str | None = None, val_data: str | None = None, backend: str = "auto",
                 precision: str = "auto", batch_size: int | None = None, gradient_accumulation: int | None = None,
                 learning_rate: float | None = None, epochs: float | None = None, max_steps: int | None = None,
                 lr_scheduler: str | None = None, warmup_steps: int | None = None, sequence_len: int | None = None,
                 lora_targets: str | None = None, lora_r: int | None = None, lora_alpha: float | None = None,
                 merge_lora: bool = False, merge_precision: str | None = None, quant_backend: str | None = None,
                 stream: bool = False, zero_offload: bool = False, tokens_per_batch: int | None = None,
                 gradient_checkpointing: bool | None = None, compile: bool = False, no_chat_template: bool = False,
                 trust_remote_code: bool = False, early_stopping: int | None = None, eval_steps: int | None = None,
                 save_steps: int | None = None, log_with: tuple[str, ...] = (), rewards: tuple[str, ...] = (),
                 seed: int | None = None) -> dict:
    """The config dict the seed's flags describe (unset flags keep mudpuppy's defaults)."""
    key = method.lower()
    if key == "preference" and preference:
        key = preference.lower()
    if key not in METHODS:
        raise MudpuppyError(f"--method {method}: not a method; choose from {', '.join(METHODS)}")
    run_method, adapter, pref = METHODS[key]
    if preference and run_method != "preference":
        raise MudpuppyError(f"--preference applies to preference methods (dpo, ipo, simpo, orpo, kto), "
                            f"not --method {method}")
    cfg: dict = {"model": {"base_model": model}, "backend": backend, "method": run_method,
                 "adapter": {"type": adapter},
                 "data": {"datasets": [{"path": data_path(data, "DATA")}]},
                 "training": {"precision": PRECISIONS.get(precision, precision)},
                 "output_dir": str(Path(output).expanduser())}
    if trust_remote_code:
        cfg["model"]["trust_remote_code"] = True
    if pref:
        cfg["preference"] = {"type": pref}
    if run_method in ONLINE:
        cfg[run_method] = {"reward_funcs": list(rewards) or ["exact_match"]}
    elif rewards:
        raise MudpuppyError("--reward applies to --method grpo (rl), rloo and online_dpo")
    if val_data:
        cfg["data"]["val_datasets"] = [{"path": data_path(val_data, "--val-data")}]
    t, d, a = cfg["training"], cfg["data"], cfg["adapter"]
    t.update({k: v for k, v in {
        "micro_batch_size": batch_size, "gradient_accumulation_steps": gradient_accumulation,
        "learning_rate": learning_rate, "max_steps": max_steps, "lr_scheduler": lr_scheduler,
        "warmup_steps": warmup_steps, "gradient_checkpointing": gradient_checkpointing,
        "eval_steps": eval_steps, "save_steps": save_steps, "seed": seed}.items() if v is not None})
    if run_method in ONLINE:
        # Whole groups per micro-batch: one of grpo.num_generations (8), four of rloo's (2) or four pairs.
        t.setdefault("micro_batch_size", 8)
    if max_steps is None:
        t["epochs"] = epochs if epochs is not None else 1
    elif epochs is not None:
        raise MudpuppyError("--epochs and --max-steps: give one of them")
    if compile:
        t["compile"] = True
    if early_stopping is not None:
        t["early_stopping_patience"] = early_stopping
        t.setdefault("eval_steps", 50)
        if not val_data:
            d["val_set_size"] = 0.05          # early stopping needs held-out data
    if sequence_len is not None:
        d["sequence_len"] = sequence_len
    if tokens_per_batch is not None:
        d["tokens_per_batch"] = tokens_per_batch
    if no_chat_template:
        d["datasets"][0]["prompt_style"] = "raw"
    if lora_targets:
        a["target_modules"] = "all-linear" if lora_targets == "all-linear" else \
            [m.strip() for m in lora_targets.split(",") if m.strip()]
    if lora_r is not None:
        a["r"] = lora_r
    if lora_alpha is not None:
        a["alpha"] = lora_alpha
    if quant_backend:
        if adapter != "qlora":
            raise MudpuppyError(f"--quant-backend applies to --method qlora, not --method {method}")
        a["quant_backend"] = quant_backend
    memory = {"stream_layers": stream, "optimizer_offload": zero_offload}
    if any(memory.values()):
        cfg["memory"] = {k: v for k, v in memory.items() if v}
    if merge_lora:
        cfg["merge"] = True
    if merge_precision:
        cfg["merge_dtype"] = MERGE_DTYPES.get(merge_precision, merge_precision)
    if log_with and set(log_with) != {"none"}:
        cfg["logging"] = {"report_to": [x for x in log_with if x != "none"]}
    return cfg


# --------------------------------------------------------------------------- init

CONFIG_TEMPLATE = """\
# mudpuppy run --config {path}
#
# Written by `mudpuppy init`. Every key is documented in docs/config.md;
# configs/ holds a working example for each method.

model:
  base_model: {model}          # HF directory, Hub id, .gguf file, or the alias smollm2-135m-instruct

backend: {backend}                  # auto, cpu, cuda, rocm or mlx (--backend overrides it)
method: {method}                  # sft, preference, rm, prm, grpo, rloo, online_dpo, gptq or qat
{method_section}
adapter:
  type: {adapter}                   # lora, dora, qlora (4-bit base), or none (full fine-tuning)
  r: 16
  alpha: 32
  target_modules: all-linear

data:
  datasets:
    - path: {data}
{val_block}  sequence_len: {sequence_len}           # longer examples are truncated (data.truncation: drop drops them)

training:
  epochs: 1
  micro_batch_size: 4
  gradient_accumulation_steps: 1
  learning_rate: {lr}
  lr_scheduler: cosine
  warmup_ratio: 0.05
  precision: auto                   # bf16 where the device computes in it, else fp32
  save_steps: 100                   # checkpoints to resume from (mudpuppy run ... --resume)

output_dir: {output}
"""


def init_config_text(path: Path, model: str, data: str, method: str, backend: str, output: str,
                     val_data: str | None = None, sequence_len: int = 1024) -> str:
    """The commented YAML `mudpuppy init` writes; validated before it is written."""
    key = method.lower()
    if key not in METHODS:
        raise MudpuppyError(f"method {method}: not a method; choose from {', '.join(METHODS)}")
    run_method, adapter, pref = METHODS[key]
    section = ""
    if pref:
        section = f"preference:\n  type: {pref}                   # dpo, ipo, simpo, orpo or kto\n  beta: 0.1\n"
    elif run_method == "grpo":
        section = ("grpo:\n  reward_funcs: [exact_match]      # built-ins, file.py:function or module:function\n"
                   "  num_generations: 8\n  max_completion_length: 64\n")
    elif run_method == "rloo":
        section = ("rloo:\n  reward_funcs: [exact_match]      # built-ins, file.py:function or module:function\n"
                   "  num_generations: 4               # each answer's baseline: the mean of the other 3\n"
                   "  max_completion_length: 64\n  beta: 0.05                       # KL to the reference, in the reward\n")
    elif run_method == "online_dpo":
        section = ("online_dpo:\n  reward_funcs: [exact_match]      # rank the two answers sampled per prompt\n"
                   "  max_completion_length: 64\n  beta: 0.1                        # DPO's pull towards the reference\n")
    base = path.parent.resolve()
    data_abs = data_path(data, "data")
    shown = _relative(data_abs, base)
    val_block = ""
    if val_data:
        val_block = f"  val_datasets:\n    - path: {_relative(data_path(val_data, 'validation data'), base)}\n"
    lr = "5.0e-6" if run_method in ("preference", *ONLINE) else "2.0e-4"
    text = CONFIG_TEMPLATE.format(path=path, model=model, backend=backend, method=run_method,
                                  method_section=("\n" + section) if section else "", adapter=adapter,
                                  data=shown, val_block=val_block, sequence_len=sequence_len, lr=lr, output=output)
    return text


def _relative(path: str, base: Path) -> str:
    p = Path(path)
    if not p.is_absolute():
        return path
    try:
        return str(p.relative_to(base))
    except ValueError:
        return str(p)


def write_init_config(path: Path, text: str) -> None:
    """Validate, then write; an existing file is never replaced."""
    from .configure import load_config

    if path.exists():
        raise MudpuppyError(f"{path} already exists; mudpuppy init never overwrites a file (choose another path)")
    cfg = yaml.safe_load(text)
    base = path.parent.resolve()
    for spec in cfg["data"]["datasets"] + cfg["data"].get("val_datasets", []):
        if (base / spec["path"]).exists():         # relative paths resolve against the config's folder
            spec["path"] = str(base / spec["path"])
    load_config(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("x", encoding="utf-8") as fh:          # "x": fails rather than replace a file made meanwhile
        fh.write(text)
