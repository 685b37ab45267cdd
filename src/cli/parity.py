"""`mudpuppy parity`: proof that two runtimes run the same run.

    mudpuppy parity CONFIG --backends cpu,mlx [--steps 5] [--json FILE] [--card RUN_DIR]

Runs the config's first steps on both backends (training/parity.py), prints a
row per step as it goes and the final comparison, and exits 0 when every
figure is within its tolerance, 1 when any is beyond (each named), 2 for a
user mistake (an unknown or unavailable backend, a config parity refuses).
"""

from __future__ import annotations

import sys

import click

from ..errors import MudpuppyError
from .common import debug_option, handle_errors, set_option


@click.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@click.option("--backends", "backend_list", required=True, metavar="A,B",
              help="The two backends to compare, comma-separated: cpu, cuda, rocm or mlx (e.g. cpu,mlx).")
@click.option("--steps", default=5, show_default=True, type=int, help="Optimizer steps to compare.")
@set_option
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="Write the result (every figure, tolerances, failures) to this JSON file.")
@click.option("--card", "card_dir", default=None, type=click.Path(file_okay=False),
              help="Write the result as a 'Runtime parity' section into this run's model card (RUN_DIR/README.md).")
@debug_option
@handle_errors
def parity(config_path, backend_list, steps, overrides, json_path, card_dir, debug):
    """Run a config's first steps on two backends and compare losses, gradient norms and the trained adapter.

    Nothing is written to the config's output_dir: both runs train in a temporary directory."""
    from .. import create_backend, load_config
    from ..backends.factory import backend_names
    from ..training.parity import check_supported, pin_precision, run_parity, summary_lines
    from ..training.parity_card import card_path, write_card_section, write_json

    names = parse_backends(backend_list, backend_names())
    if steps < 1:
        raise MudpuppyError(f"--steps {steps}: compare at least 1 step")
    asked = load_config(config_path, list(overrides))
    check_supported(asked)
    cfg = pin_precision(asked)
    if card_dir is not None:
        card_path(card_dir)                       # a wrong directory is named before minutes of training
    impls = [create_backend(name, **cfg.backend_options()) for name in names]
    pinned = " (auto resolves per runtime: both run fp32; --set training.precision=bf16 compares bf16)" \
        if asked.training.precision != cfg.training.precision else ""
    click.echo(f"parity: {config_path}, method {cfg.data_method()}, adapter {cfg.adapter.type}, "
               f"training.precision {cfg.training.precision}{pinned}; "
               + " vs ".join(f"{b.name} on {b.device}" for b in impls))
    result = run_parity(cfg, impls, names, steps, echo=click.echo)
    for line in summary_lines(result):
        click.echo(line)
    if json_path:
        click.echo(f"wrote {write_json(json_path, result)}")
    if card_dir is not None:
        click.echo(f"wrote the 'Runtime parity' section of {write_card_section(card_dir, result, config_path)}")
    if not result.ok:
        sys.exit(1)


def parse_backends(text: str, known: list[str]) -> list[str]:
    """Two distinct known backend names from 'a,b'."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if len(names) != 2 or names[0] == names[1]:
        raise MudpuppyError(f"--backends {text}: name two different backends, e.g. --backends cpu,mlx "
                            f"(choose from {', '.join(known)})")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise MudpuppyError(f"--backends {text}: unknown backend {unknown[0]!r}; choose two of {', '.join(known)} "
                            "(auto is refused: parity names the runtimes it compares)")
    return names
