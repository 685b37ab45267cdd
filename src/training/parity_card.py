"""A parity result as a "Runtime parity" section of a run's model card (README.md), and as JSON.

The card is the one a finished run writes (monitor/report.py); this module
adds or replaces its own section and leaves the rest of the file as it was,
so running `mudpuppy parity --card` again updates the section in place. The
file is written beside itself and renamed over it: a reader never sees half.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from ..errors import MudpuppyError
from ..files import write_json_atomic

CARD = "README.md"
HEADING = "## Runtime parity"


def card_path(run_dir: str | Path) -> Path:
    """The run's model card, checked before anything trains."""
    card = Path(run_dir) / CARD
    if not card.is_file():
        raise MudpuppyError(f"--card {run_dir}: no model card ({CARD}) there; give the output directory of a "
                            "finished run")
    return card


def card_section(result, config_name: str) -> str:
    a, b = result.backends
    tol = result.tolerances
    day = datetime.date.today().isoformat()
    lines = [HEADING, "",
             f"`mudpuppy parity {config_name} --backends {a},{b} --steps {result.steps_asked}` ran this run's "
             f"first {len(result.rows)} optimizer steps on {a} ({result.devices[0]}) and {b} ({result.devices[1]}) "
             f"from the same initial weights and the same batches, on {day} (training.precision "
             f"{result.precision}, {result.tolerance_class} tolerances).", "",
             f"| step | loss {a} | loss {b} | abs diff | grad norm {a} | grad norm {b} | abs diff |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result.rows:
        ga, gb = (f"{g:.6f}" if g is not None else "-" for g in r.grad_norm)
        gd = f"{r.grad_diff:.2e}" if r.grad_diff is not None else "-"
        lines.append(f"| {r.step} | {r.loss[0]:.6f} | {r.loss[1]:.6f} | {r.loss_diff:.2e} | {ga} | {gb} | {gd} |")
    layout = "compared in PEFT layout" if result.compared == "adapter" else "every weight of the saved models"
    lines += ["", f"Final {result.compared} ({result.tensors} tensors, {layout}): largest absolute "
                  f"difference {result.max_abs:.2e} (the largest change training made: {result.max_update:.2e}); "
                  f"difference relative to the update {result.relative:.2e}.", ""]
    limits = (f"loss {tol.loss:g} and gradient norm {tol.grad_norm:g} (absolute below 1, relative above), "
              f"{result.compared} {tol.adapter_max:g} (largest difference over largest change) and "
              f"{tol.adapter_rel:g} (relative)")
    if result.ok:
        lines.append(f"Result: **within tolerances** ({limits}; docs/cli.md, `mudpuppy parity`).")
    else:
        lines.append(f"Result: **beyond tolerances** ({limits}; docs/cli.md, `mudpuppy parity`):")
        lines += [""] + [f"- {f}" for f in result.failures]
    return "\n".join(lines) + "\n"


def write_card_section(run_dir: str | Path, result, config_name: str) -> Path:
    """Add the section to the run's card, or replace the one an earlier parity run wrote."""
    card = card_path(run_dir)
    text = card.read_text(encoding="utf-8")
    section = card_section(result, config_name)
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == HEADING), None)
    if start is None:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        rest = "".join(lines[end:])
        new = "".join(lines[:start]) + section + ("\n" + rest if rest else "")
    tmp = card.with_name(card.name + ".tmp")
    tmp.write_text(new, encoding="utf-8")
    os.replace(tmp, card)
    return card


def write_json(path: str | Path, result) -> Path:
    path = Path(path)
    if path.parent and not path.parent.is_dir():
        raise MudpuppyError(f"--json {path}: the directory {path.parent} does not exist")
    write_json_atomic(path, result.as_dict())
    return path
