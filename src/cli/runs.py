"""The training verbs: `run` (a config, a curriculum, or N processes with --nproc) and `train` (the seed's
flags instead of a YAML file). Both end in `_train`: the run here or under N processes, then its table."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import MudpuppyError
from .common import debug_option, handle_errors, set_option, tui_option
from .tables import before_after_table

allow_changes_option = click.option(
    "--allow-changes", is_flag=True,
    help="With --resume: continue although training settings or data differ from the checkpoint's; each "
         "change is recorded (metrics.jsonl, run_summary.json) at the step it takes effect.")


@click.command()
@click.argument("config_file", required=False, metavar="[CONFIG]", type=click.Path(dir_okay=False))
@click.option("--config", "-c", "config_path", default=None, type=click.Path(dir_okay=False),
              help="The run's YAML file (or give it as the argument).")
@click.option("--backend", "-b", default=None, help="auto, cpu, cuda, rocm or mlx (overrides the config).")
@set_option
@click.option("--overwrite", is_flag=True, help="Replace an output_dir that already holds a run.")
@click.option("--resume", is_flag=True, help="Continue from the newest complete checkpoint in output_dir.")
@allow_changes_option
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="Train with N processes on this node: torchrun's engine (torch), mlx.launch (MLX). "
                   "See docs/distributed.md for several nodes.")
@tui_option
@debug_option
@handle_errors
def run(config_file, config_path, backend, overrides, overwrite, resume, allow_changes, nproc, tui, debug):
    """Run the training job a config describes: mudpuppy run CONFIG (or -c CONFIG)."""
    from .. import load_config
    from ..training.curriculum import is_curriculum

    if config_file and config_path and Path(config_file) != Path(config_path):
        raise MudpuppyError(f"two configs given ({config_file} and --config {config_path}); give one")
    config_path = config_path or config_file
    if not config_path:
        raise MudpuppyError("no config: mudpuppy run CONFIG.yaml (or -c CONFIG.yaml); `mudpuppy init` writes one, "
                            "`mudpuppy train MODEL DATA --method lora` runs without one")
    if is_curriculum(config_path):
        if nproc and nproc > 1:
            raise MudpuppyError("--nproc: a curriculum runs in one process for now")
        _run_curriculum(config_path, list(overrides) + ([f"backend={backend}"] if backend else [])
                        + (["logging.tui=true"] if tui else []), overwrite, allow_changes)
        return
    overrides = list(overrides) + ([f"backend={backend}"] if backend else []) + (["resume=true"] if resume else [])
    overrides += ["logging.tui=true"] if tui else []
    _train(load_config(config_path, overrides), overwrite, nproc, allow_changes)


def _train(cfg, overwrite: bool, nproc: int | None, allow_changes: bool = False) -> None:
    """Run a validated config: here, or under N processes."""
    from .. import create_backend
    from ..distributed import launched
    from ..training import run as run_method

    if allow_changes and not cfg.resume:
        raise MudpuppyError("--allow-changes: it lets a resumed run continue with changed settings; add --resume "
                            "(or resume: true / auto in the config)")
    if nproc and nproc > 1:
        if launched():
            raise MudpuppyError("--nproc: this process is already one of a distributed run (started by torchrun or "
                                "mlx.launch); drop --nproc, the launcher sets the number of processes")
        sys.exit(_launch(cfg, nproc))
    from ..monitor.live import watch_run

    with watch_run(cfg.logging.tui) as echo:       # the dashboard (or plain lines) from before the model loads
        impl = create_backend(cfg.backend, **cfg.backend_options())
        # In a distributed run rank 0 speaks for all.
        main = getattr(impl, "ranks", None) is None or impl.ranks.is_main
        say = echo if main else (lambda *_a, **_k: None)
        say(f"backend: {impl.name} on {impl.device}")
        for note in getattr(getattr(impl, "plan", None), "notes", []):
            say(f"  {note}")
        result = run_method(cfg, impl, overwrite=overwrite, echo=say, allow_changes=allow_changes)
    say = click.echo if main else say                 # the dashboard has stopped: the table goes below it
    say(before_after_table(result))
    say(f"saved to {result.output_dir} ({result.steps} steps, {result.seconds:.0f} s, "
               f"{result.tokens_per_second:.0f} tokens/s while training)")


@click.command()
@click.argument("model")
@click.argument("data")
@click.option("--method", "-m", default="lora", show_default=True,
              help="full, lora, dora, qlora, dpo, ipo, simpo, orpo, kto (or preference + --preference), "
                   "grpo (rl), rm, prm, gptq, qat.")
@click.option("--preference", default=None, help="With --method preference: dpo, ipo, simpo, orpo or kto.")
@click.option("--output", "-o", default="outputs", show_default=True, help="output_dir.")
@click.option("--val-data", default=None, help="Held-out data file.")
@click.option("--backend", "-b", default="auto", show_default=True, help="auto, cpu, cuda, rocm or mlx.")
@click.option("--precision", default="auto", show_default=True,
              type=click.Choice(["auto", "fp32", "bf16", "fp16", "fp8"]))
@click.option("--batch-size", type=int, default=None, help="training.micro_batch_size")
@click.option("--gradient-accumulation", type=int, default=None, help="training.gradient_accumulation_steps")
@click.option("--learning-rate", "--lr", type=float, default=None, help="training.learning_rate")
@click.option("--epochs", type=float, default=None, help="training.epochs (default 1)")
@click.option("--max-steps", type=int, default=None, help="training.max_steps (instead of --epochs)")
@click.option("--lr-scheduler", default=None, help="linear, cosine, cosine_with_restarts, polynomial, constant")
@click.option("--warmup-steps", type=int, default=None)
@click.option("--sequence-len", type=int, default=None, help="data.sequence_len")
@click.option("--lora-targets", default=None, help="Comma-separated module names, or all-linear.")
@click.option("--lora-r", type=int, default=None)
@click.option("--lora-alpha", type=float, default=None)
@click.option("--quant-backend", default=None, type=click.Choice(["int4", "mxfp4"]), help="QLoRA's 4-bit format.")
@click.option("--merge-lora", is_flag=True, help="Merge the adapter into the base at the end.")
@click.option("--merge-precision", default=None, type=click.Choice(["fp16", "bf16", "fp32"]))
@click.option("--stream", is_flag=True, help="memory.stream_layers (ROCm/CUDA)")
@click.option("--zero-offload", is_flag=True, help="memory.optimizer_offload (ROCm/CUDA)")
@click.option("--tokens-per-batch", type=int, default=None, help="data.tokens_per_batch")
@click.option("--gradient-checkpointing/--no-gradient-checkpointing", default=None)
@click.option("--compile", "compile_", is_flag=True, help="training.compile")
@click.option("--no-chat-template", is_flag=True, help="Render prompts raw instead of through the chat template.")
@click.option("--trust-remote-code", is_flag=True)
@click.option("--early-stopping", type=int, default=None, help="Stop after N evaluations without improvement.")
@click.option("--eval-steps", type=int, default=None)
@click.option("--save-steps", type=int, default=None)
@click.option("--log-with", multiple=True, type=click.Choice(["none", "tensorboard", "mlflow", "trackio", "wandb"]),
              help="Trackers (repeatable): logging.report_to.")
@click.option("--reward", "rewards", multiple=True, help="GRPO reward function (repeatable; default exact_match).")
@click.option("--seed", type=int, default=None)
@click.option("--write-config", type=click.Path(dir_okay=False), default=None,
              help="Write the config to this file and stop (nothing trains).")
@click.option("--overwrite", is_flag=True, help="Replace an output directory that already holds a run.")
@click.option("--resume", is_flag=True, help="Continue from the newest complete checkpoint in --output.")
@allow_changes_option
@click.option("--nproc", type=click.IntRange(min=1), default=None, help="Train with N processes on this node.")
@tui_option
@debug_option
@handle_errors
def train(model, data, method, preference, output, val_data, backend, precision, batch_size, gradient_accumulation,
          learning_rate, epochs, max_steps, lr_scheduler, warmup_steps, sequence_len, lora_targets, lora_r, lora_alpha,
          quant_backend, merge_lora, merge_precision, stream, zero_offload, tokens_per_batch, gradient_checkpointing,
          compile_, no_chat_template, trust_remote_code, early_stopping, eval_steps, save_steps, log_with, rewards,
          seed, write_config, overwrite, resume, allow_changes, nproc, tui, debug):
    """Train MODEL on DATA without a YAML file (the seed's command line): mudpuppy train MODEL DATA --method lora.

    The flags become a config (docs/cli.md#train says which key each sets); the run writes it to
    OUTPUT/config.yaml, so `mudpuppy run OUTPUT/config.yaml` repeats it."""
    import yaml

    from .. import load_config
    from ..shortcuts import train_config

    raw = train_config(
        model, data, method, output, preference=preference, val_data=val_data, backend=backend, precision=precision,
        batch_size=batch_size, gradient_accumulation=gradient_accumulation, learning_rate=learning_rate,
        epochs=epochs, max_steps=max_steps, lr_scheduler=lr_scheduler, warmup_steps=warmup_steps,
        sequence_len=sequence_len, lora_targets=lora_targets, lora_r=lora_r, lora_alpha=lora_alpha,
        merge_lora=merge_lora, merge_precision=merge_precision, quant_backend=quant_backend, stream=stream,
        zero_offload=zero_offload, tokens_per_batch=tokens_per_batch, gradient_checkpointing=gradient_checkpointing,
        compile=compile_, no_chat_template=no_chat_template, trust_remote_code=trust_remote_code,
        early_stopping=early_stopping, eval_steps=eval_steps, save_steps=save_steps, log_with=log_with,
        rewards=rewards, seed=seed)
    if resume:
        raw["resume"] = True
    if tui:
        raw.setdefault("logging", {})["tui"] = True
    cfg = load_config(raw)                      # a bad flag gets the config's message, naming the key it sets
    if write_config:
        target = Path(write_config)
        if target.exists():
            raise MudpuppyError(f"--write-config {target}: the file exists; choose another name")
        target.write_text(f"# mudpuppy run --config {target}\n" + yaml.safe_dump(raw, sort_keys=False),
                          encoding="utf-8")
        click.echo(f"wrote {target}; run it with: mudpuppy run {target}")
        return
    click.echo(f"config: {cfg.method}, adapter {cfg.adapter.type}, {cfg.output_dir}/config.yaml once the run starts")
    _train(cfg, overwrite, nproc, allow_changes)


def _run_curriculum(config_path, overrides: list[str], overwrite: bool, allow_changes: bool = False) -> None:
    """A config with `stages:`: each stage a run, resumed where it stopped when run again (--resume is implied)."""
    from ..monitor.live import watch_run
    from ..training.curriculum import load_curriculum, run_curriculum

    cur = load_curriculum(config_path, overrides)
    with watch_run(any(stage.cfg.logging.tui for stage in cur.stages)) as echo:
        echo(f"curriculum: {len(cur.stages)} stages -> {cur.output_dir}")
        result = run_curriculum(cur, overwrite=overwrite, echo=echo, allow_changes=allow_changes)
    click.echo(f"report: {result.output_dir / 'curriculum.md'} ({len(result.ran)} stages trained now)")


def _launch(cfg, nproc: int) -> int:
    from ..backends.factory import resolve_auto
    from ..launch import child_arguments, launch

    name = cfg.backend if cfg.backend != "auto" else resolve_auto().name
    if name == "mlx" and cfg.distributed.strategy == "fsdp":
        raise MudpuppyError("distributed.strategy: fsdp is torch's (FSDP2); MLX trains data-parallel only: "
                            "use strategy: ddp with the mlx backend")
    args = child_arguments(sys.argv[sys.argv.index("run") + 1:])
    return launch(cfg, name, nproc, args, echo=click.echo)
