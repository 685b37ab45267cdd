"""The `mudpuppy` command line.

User mistakes end in one message on stderr and exit code 2; `--debug` shows
the traceback. Anything else is a mudpuppy bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import sys
import traceback

import click

from .errors import MudpuppyError


def _handle_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = kwargs.get("debug", False)
        try:
            return fn(*args, **kwargs)
        except MudpuppyError as exc:
            if debug:
                traceback.print_exc()
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


config_option = click.option("--config", "-c", "config_path", required=True,
                             type=click.Path(dir_okay=False), help="The run's YAML file.")
set_option = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                          help="Override a config value, e.g. --set training.max_steps=5 (repeatable).")
debug_option = click.option("--debug", is_flag=True, help="Show tracebacks for user errors too.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mudpuppy")
def main():
    """Fine-tune language models on ROCm, CUDA, CPU or MLX from one YAML file."""


@main.command()
@config_option
@click.option("--backend", "-b", default=None, help="auto, cpu, cuda, rocm or mlx (overrides the config).")
@set_option
@click.option("--overwrite", is_flag=True, help="Replace an output_dir that already holds a run.")
@debug_option
@_handle_errors
def run(config_path, backend, overrides, overwrite, debug):
    """Run the training job a config describes."""
    from . import create_backend, load_config
    from .training import run as run_method

    overrides = list(overrides) + ([f"backend={backend}"] if backend else [])
    cfg = load_config(config_path, overrides)
    impl = create_backend(cfg.backend)
    click.echo(f"backend: {impl.name} on {impl.device}")
    result = run_method(cfg, impl, overwrite=overwrite, echo=click.echo)
    click.echo(_table(result))
    click.echo(f"saved to {result.output_dir} ({result.steps} steps, {result.seconds:.0f} s, "
               f"{result.tokens_per_second:.0f} tokens/s while training)")


@main.command()
@click.argument("config_path", type=click.Path(dir_okay=False))
@set_option
@debug_option
@_handle_errors
def validate(config_path, overrides, debug):
    """Check a config (schema, values, data files) without loading a model."""
    from .config import load_config

    cfg = load_config(config_path, overrides)
    click.echo(f"{config_path}: ok (method {cfg.method}, adapter {cfg.adapter.type}, backend {cfg.backend}, "
               f"{len(cfg.data.datasets)} dataset(s))")


@main.command()
@debug_option
@_handle_errors
def backends(debug):
    """List every backend, whether it works here, and why not."""
    from .backends.factory import describe, probe_all

    for a in probe_all():
        status = f"available  {a.device}" if a.available else f"unavailable  {a.reason}"
        click.echo(f"{a.name:5s} {status}")
        click.echo(f"      {describe(a.name)}")


def _table(result) -> str:
    before, after = result.before, result.after
    if before is None and after is None:
        return ""
    rows = [("", "before", "after")]

    def cell(ev, attr, fmt):
        value = getattr(ev, attr, None) if ev else None
        return fmt.format(value) if value is not None else "-"

    if any(getattr(e, "loss", None) is not None for e in (before, after)):
        rows.append(("held-out loss", cell(before, "loss", "{:.4f}"), cell(after, "loss", "{:.4f}")))
    if any(getattr(e, "exact_match", None) is not None for e in (before, after)):
        rows.append(("exact match", cell(before, "exact_match", "{:.1%}"), cell(after, "exact_match", "{:.1%}")))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
