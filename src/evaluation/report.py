"""What `mudpuppy eval` leaves behind: the terminal table, eval.json, eval.md and a bar chart per row.

The files are written under the output contract (mudpuppy.output_dir): built in a hidden folder beside the
output directory and renamed in once all are written; an earlier evaluation there (eval.json, eval.md
and its charts, nothing else) is replaced only with --overwrite, after the new one is in place; other
files in the directory stay. The charts need matplotlib (`pip install 'mudpuppy[plot]'`); without
it they are skipped with one line, and everything else is written.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict
from pathlib import Path

from ..files import write_json_atomic
from ..output_dir import EVAL, writing
from .metrics import Row

EVAL_JSON = "eval.json"
EVAL_MD = "eval.md"


def out_dir_for(out: str | None, columns) -> Path:
    """--out, else <first target>/eval for a run, else ./eval-<timestamp>."""
    if out:
        return Path(out).expanduser()
    if columns[0].kind == "run":
        return Path(columns[0].target).expanduser() / "eval"
    return Path(f"eval-{time.strftime('%Y%m%d-%H%M%S')}")


def writing_report(out: Path, overwrite: bool, echo=None):
    """The output contract's writing context for an evaluation in `out` (output_dir.writing): entered before
    any model loads, so a directory holding an earlier evaluation is refused at once without --overwrite."""
    return writing(out, EVAL, overwrite, what="--out", echo=echo)


def publish_report(report, out: Path, overwrite: bool = True, echo=print) -> list[str]:
    """write_report into `out` under the contract at once (a run's held-out report, measured already)."""
    with writing_report(out, overwrite, echo) as written:
        return write_report(report, written.dir, echo, shown=out)


# --------------------------------------------------------------------------- the table

def format_value(row: Row, value: float | None) -> str:
    if value is None:
        return "-"
    if row.style == "percent":
        return f"{value:.1%}"
    if row.style == "signed":
        return f"{value:+.4f}"
    return f"{value:.4f}" if value < 1000 else f"{value:.4g}"


def table_cells(report) -> list[list[str]]:
    header = [""] + [m.name for m in report.models]
    return [header] + [[row.label] + [format_value(row, m.values.get(row.key)) for m in report.models]
                       for row in report.rows]


def format_table(report) -> str:
    cells = table_cells(report)
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def markdown_table(report) -> str:
    cells = table_cells(report)
    head = "| " + " | ".join(cells[0]) + " |"
    rule = "| --- |" + " ---: |" * (len(cells[0]) - 1)
    return "\n".join([head, rule] + ["| " + " | ".join(r) + " |" for r in cells[1:]])


# --------------------------------------------------------------------------- files

def write_report(report, out: Path, echo=print, shown: Path | None = None) -> list[str]:
    """Charts, eval.md, then eval.json in `out` (a staging folder, bound for `shown`); returns the charts."""
    out.mkdir(parents=True, exist_ok=True)
    charts = write_charts(report, out)
    if charts is None:
        echo("charts: matplotlib is not installed, so no PNG charts (pip install 'mudpuppy[plot]')")
        charts = []
    (out / EVAL_MD).write_text(markdown(report, charts), encoding="utf-8")
    write_json_atomic(out / EVAL_JSON, as_json(report, charts))
    echo(f"\n{format_table(report)}\n")
    made = f", eval.md and {len(charts)} chart{'s' if len(charts) != 1 else ''}" if charts else " and eval.md"
    echo(f"saved eval.json{made} to {shown or out}")
    return charts


def as_json(report, charts: list[str]) -> dict:
    opts = report.options
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "data": {"path": report.data, "format": report.format, "records": report.records} if report.data else None,
        "metrics": report.metrics,
        "tasks": opts.tasks,
        "backend": report.backend, "device": report.device,
        "options": {"precision": opts.precision, "max_samples": opts.max_samples, "batch_size": opts.batch_size,
                    "max_new_tokens": opts.max_new_tokens, "normalize": normalize_names(opts),
                    "regex": opts.regex, "beta": opts.beta, **voice_options(report), **task_options(opts)},
        "rows": [asdict(row) for row in report.rows],
        "models": [{"name": m.name, "target": m.target, "kind": m.kind, "description": m.description,
                    "values": m.values, "details": m.details, "answers": m.answers, "misses": m.misses,
                    "seconds": round(m.seconds, 2)}
                   for m in report.models],
        "charts": charts,
    }


def normalize_names(opts) -> list[str]:
    return [name for name, on in (("strip", opts.strip), ("casefold", opts.casefold)) if on]


def voice_options(report) -> dict:
    if "voice_fidelity" not in report.metrics:
        return {}
    from .voice import resolve_embedding_model

    model = resolve_embedding_model(report.options.embedding_model)
    return {"embedding_model": model.name, "embedding_model_path": model.path}


def task_options(opts) -> dict:
    if not opts.tasks:
        return {}
    return {"include_path": opts.include_path, "tasks_chat_template": opts.tasks_chat_template,
            "task_limit": opts.max_samples}


def markdown(report, charts: list[str]) -> str:
    opts = report.options
    what = f"{report.records} {report.format} records" if report.data else f"lm-eval tasks {', '.join(opts.tasks)}"
    lines = [f"# Evaluation on {report.data or ', '.join(opts.tasks)}", "",
             f"{what}; backend {report.backend}"
             + (f" ({report.device})" if str(report.device) != report.backend else "")
             + f", precision {opts.precision}.", "", markdown_table(report), ""]
    lines += [f"- **{m.name}**: {m.description} ("
              + (f"{m.details['examples']} examples, " if m.details.get("examples") else "") + f"{m.seconds:.0f} s)"
              for m in report.models]
    if any(row.key in ("exact_match", "contains", "regex") for row in report.rows):
        lines += ["", f"Answers: greedy, at most {opts.max_new_tokens} new tokens; compared after "
                      f"{' and '.join(normalize_names(opts)) or 'no'} normalisation"
                      + (f"; regex `{opts.regex}`" if opts.regex else "") + "."]
    if "voice_fidelity" in report.metrics:
        lines += ["", f"Voice fidelity: the mean cosine similarity of each greedy answer (at most "
                      f"{opts.max_new_tokens} new tokens) with its reference, embedded by "
                      f"{voice_options(report)['embedding_model']}."]
    if opts.tasks:
        lines += ["", f"lm-evaluation-harness tasks {', '.join(opts.tasks)}"
                      + (f" from {opts.include_path}" if opts.include_path else "")
                      + (f", the first {opts.max_samples} documents of each" if opts.max_samples else "")
                      + (", prompts through the chat template" if opts.tasks_chat_template else "") + "."]
    lines += [""] + [f"![{name}]({name})" for name in charts]
    missed = [m for m in report.models if m.misses]
    if missed:
        lines += ["", "## Missed answers (the first few per model)", "", "| model | reference | answer |",
                  "| --- | --- | --- |"]
        lines += [f"| {m.name} | {cell(row['reference'])} | {cell(row['answer'])} |"
                  for m in missed for row in m.misses]
    lowest = [m for m in report.models if m.details.get("voice_fidelity_lowest")]
    if lowest:
        lines += ["", "## Least similar answers (voice fidelity, per model)", "",
                  "| model | similarity | reference | answer |", "| --- | ---: | --- | --- |"]
        lines += [f"| {m.name} | {row['similarity']:.4f} | {cell(row['reference'])} | {cell(row['answer'])} |"
                  for m in lowest for row in m.details["voice_fidelity_lowest"]]
    return "\n".join(lines).rstrip() + "\n"


def cell(text: str) -> str:
    """Text inside a Markdown table cell: one line, pipes escaped, code-quoted so markup shows as written."""
    flat = " ".join(text.split()).replace("|", "\\|").replace("`", "'")
    return f"`{flat}`" if flat else "(empty)"


def chart_name(key: str) -> str:
    """A row key as a file name: lm-eval rows ("arc_easy:acc") keep letters, digits, '_', '-' and '.'."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key)


def write_charts(report, out: Path) -> list[str] | None:
    """One bar chart per table row, the models side by side; None when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure     # no pyplot: no GUI backend, no global state
    except ImportError:
        return None
    names = [m.name for m in report.models]
    written = []
    for row in report.rows:
        values = [m.values.get(row.key) for m in report.models]
        fig = Figure(figsize=(max(4.0, 1.3 * len(names) + 1.5), 3.2), layout="constrained")
        ax = fig.add_subplot()
        bars = ax.bar(names, [v if v is not None else 0.0 for v in values], color="#4c72b0")
        ax.bar_label(bars, labels=[format_value(row, v) for v in values], padding=2, fontsize=9)
        better = "higher" if row.higher_is_better else "lower"
        ax.set_title(f"{row.label} ({better} is better)", fontsize=10)
        if row.style == "percent":
            ax.set_ylim(0, 1.12)
            ax.yaxis.set_major_formatter(lambda y, _: f"{y:.0%}")
        else:
            ax.margins(y=0.15)
        ax.spines[["top", "right"]].set_visible(False)
        name = f"{chart_name(row.key)}.png"
        fig.savefig(out / name, dpi=120)
        written.append(name)
    return written
