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

    def pick(value, prompt, default, check=None, **kw):
        """A flag's value or the default, checked now; on a terminal the answer, checked as it is given (a
        bad one is said and asked again), not after every question."""
        if value is not None or not ask:
            value = value if value is not None else default
            return check(value) if check and value is not None else value
        return click.prompt(prompt, default=default, value_proc=_asked_again(check) if check else None, **kw)

    model = pick(model, "Base model (HF dir, Hub id, .gguf, or alias)", "smollm2-135m-instruct", check_model)
    data = pick(data, "Training data file (jsonl, json, csv, parquet)", None, check_data("--data"))
    if not data:
        raise MudpuppyError("--data: a training data file is needed (mudpuppy init --data train.jsonl)")
    if val_data is not None:
        check_data("--val-data")(val_data)
    method = pick(method, "Method", "lora", type=click.Choice(list(METHODS)))
    backend = pick(backend, "Backend", "auto", type=click.Choice(["auto", "cpu", "cuda", "rocm", "mlx"]))
    output = pick(output, "Output directory", f"outputs/{method}", check_output)
    text = init_config_text(target, model, data, method, backend, output, val_data=val_data)
    write_init_config(target, text)
    click.echo(f"wrote {target}; check it with `mudpuppy validate {target}`, run it with `mudpuppy run {target}`")


def _asked_again(check):
    """click's value_proc: a MudpuppyError becomes click's BadParameter, which the prompt shows and asks again."""
    def proc(text):
        try:
            return check(text)
        except MudpuppyError as exc:
            raise click.BadParameter(str(exc)) from None
    return proc


def check_model(value: str) -> str:
    """A base model that can be found: a local directory with config.json, a .gguf file, an alias or a Hub id."""
    from ..backends.models import MODEL_ALIASES, looks_like_local_path

    path = Path(value).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise MudpuppyError(f"model: {value} is a directory without config.json, not a model")
    if not path.exists() and looks_like_local_path(value):
        raise MudpuppyError(f"model: {value} does not exist (a model directory, a .gguf file, a Hub id as owner/name, "
                            f"or one of {', '.join(MODEL_ALIASES)})")
    return value


def check_data(flag: str):
    def check(value: str) -> str:
        from ..shortcuts import data_path

        data_path(value, flag)              # a local file that exists, or owner/name on the Hub
        if Path(value).expanduser().is_dir():
            raise MudpuppyError(f"{flag}: {value} is a directory; give a data file (jsonl, json, csv, parquet)")
        return value
    return check


def check_output(value: str) -> str:
    if Path(value).expanduser().is_file():
        raise MudpuppyError(f"output directory: {value} is a file; give a directory for the run")
    return value


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
