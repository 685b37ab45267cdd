"""Getting started: `init` writes a commented config from a few answers, `backends` says which runtimes work
on this machine and why the others do not."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import MudpuppyError
from .common import debug_option, handle_errors


@click.command()
@click.argument("path", required=False, default="mudpuppy.yaml", type=click.Path(dir_okay=False))
@click.option("--model", default=None, help="Base model (default: smollm2-135m-instruct).")
@click.option("--data", default=None, help="Training data file.")
@click.option("--val-data", default=None, help="Held-out data file (optional).")
@click.option("--method", default=None, help="lora, qlora, full, dpo, orpo, kto, grpo, rm, ...")
@click.option("--backend", default=None, help="auto, cpu, cuda, rocm or mlx.")
@click.option("--output", default=None, help="output_dir (default: outputs/<method>).")
@click.option("--yes", "-y", is_flag=True, help="Ask nothing: flags and defaults only.")
@debug_option
@handle_errors
def init(path, model, data, val_data, method, backend, output, yes, debug):
    """Write a commented config by answering a few questions (or from flags with --yes); never overwrites."""
    from ..shortcuts import METHODS, init_config_text, write_init_config

    target = Path(path)
    if target.exists():
        raise MudpuppyError(f"{target} already exists; mudpuppy init never overwrites a file (give another path)")
    ask = not yes and sys.stdin.isatty()

    def pick(value, prompt, default, **kw):
        if value is not None or not ask:
            return value if value is not None else default
        return click.prompt(prompt, default=default, **kw)

    model = pick(model, "Base model (HF dir, Hub id, .gguf, or alias)", "smollm2-135m-instruct")
    data = pick(data, "Training data file (jsonl, json, csv, parquet)", None)
    if not data:
        raise MudpuppyError("--data: a training data file is needed (mudpuppy init --data train.jsonl)")
    method = pick(method, "Method", "lora", type=click.Choice(list(METHODS)))
    backend = pick(backend, "Backend", "auto", type=click.Choice(["auto", "cpu", "cuda", "rocm", "mlx"]))
    output = pick(output, "Output directory", f"outputs/{method}")
    text = init_config_text(target, model, data, method, backend, output, val_data=val_data)
    write_init_config(target, text)
    click.echo(f"wrote {target}; check it with `mudpuppy validate {target}`, run it with `mudpuppy run {target}`")


@click.command()
@debug_option
@handle_errors
def backends(debug):
    """List every backend, whether it works here, and why not."""
    from ..backends.factory import describe, probe_all

    for a in probe_all():
        status = f"available  {a.device}" if a.available else f"unavailable  {a.reason}"
        click.echo(f"{a.name:5s} {status}")
        click.echo(f"      {describe(a.name)}")
