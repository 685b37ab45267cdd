"""The eval suite's metrics for a run that has just trained (today: `eval.voice_fidelity`), measured on
the run's held-out sets, on the model it ended with and on the model it started from:

    after    the trained model, already in memory (or loaded from output_dir when a curriculum
             finds a stage that finished without this measurement)
    before   the starting point, loaded: the base model, or the base with the adapter the run was
             initialised from (adapter.init_from: a curriculum's previous stage); with
             eval.before_training only
    written  output_dir/heldout-eval/ as `mudpuppy eval` writes (eval.json last, eval.md, charts),
             two columns, before and after

Every check (held-out sets, their formats, the embedding model) runs before anything trains:
`check_trained_metrics` is called when the config is read.
"""

from __future__ import annotations

import functools
import gc
import json
import time
from dataclasses import replace
from pathlib import Path

from ..data.prepare import load_dataset
from ..errors import MudpuppyError
from . import voice
from .metrics import METRICS
from .report import EVAL_JSON
from .targets import Column

OUT_DIR = "heldout-eval"


def trained_metrics(cfg) -> list[str]:
    """The suite metrics a run's eval section asks for after training."""
    return ["voice_fidelity"] if cfg.eval.voice_fidelity else []


def check_trained_metrics(cfg, where: str = "eval") -> list[tuple[str, str]]:
    """(config path, problem) for each reason the run's suite metrics could not be measured; no model loads.
    The held-out files are not read here (the config check reports missing files)."""
    metrics = trained_metrics(cfg)
    if not metrics:
        return []
    problems = []
    if not cfg.data.val_datasets:
        problems.append((f"{where}.voice_fidelity", "needs held-out sets with reference answers: give "
                                                    "data.val_datasets (conversations or preference pairs)"))
    try:
        voice.resolve_embedding_model(cfg.eval.embedding_model, where=f"{where}.embedding_model")
    except MudpuppyError as exc:
        problems.append((f"{where}.voice_fidelity", str(exc)))
    return problems


def is_measured(out: Path) -> bool:
    return (Path(out) / OUT_DIR / EVAL_JSON).is_file()


def read_measured(out: Path) -> dict[str, dict]:
    """{"before": {metric: value}, "after": {...}} from an earlier measurement ({} when there is none)."""
    try:
        report = json.loads((Path(out) / OUT_DIR / EVAL_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {m["name"]: {k: v for k, v in m["values"].items() if v is not None} for m in report.get("models", [])}


def measure_trained(cfg, backend, trained=None, echo=print) -> dict[str, dict]:
    """Measure the trained model (`trained.model`, a RunResult's handle, else loaded from cfg.output_dir)
    and, with eval.before_training, the model the run started from, one model in memory at a time;
    write output_dir/heldout-eval/. Returns {"before": {metric: value}, "after": {...}}."""
    from .report import publish_report
    from .suite import EvalOptions, EvalReport

    metrics = trained_metrics(cfg)
    if not metrics:
        return {}
    problems = check_trained_metrics(cfg)
    if problems:
        raise MudpuppyError("; ".join(f"{path}: {message}" for path, message in problems))
    out = Path(cfg.output_dir)
    datasets = heldout_sets(cfg)
    options = EvalOptions(metrics=metrics, max_new_tokens=cfg.eval.max_new_tokens, batch_size=cfg.eval.batch_size,
                          embedding_model=cfg.eval.embedding_model, precision=cfg.training.precision)
    handle = None
    if trained is not None:
        handle, trained.model = trained.model, None      # this function holds the last reference: freed below
    results = [measure_column(backend, trained_column(cfg), datasets, options, handle)]
    del handle
    gc.collect()                # the trained model is gone before the starting one loads
    if cfg.eval.before_training:
        results.insert(0, measure_column(backend, starting_column(cfg), datasets, options))
    report = EvalReport(", ".join(ds.name for ds in datasets), datasets[0].format,
                        sum(len(ds.records) for ds in datasets), metrics,
                        [row for m in metrics for row in METRICS[m].rows], results, backend.name,
                        getattr(backend, "device", ""), options)
    publish_report(report, out / OUT_DIR, echo=lambda *_: None)    # beside, then renamed in (output_dir/staging.py)
    values = {m.name: {k: v for k, v in m.values.items() if v is not None} for m in results}
    said = [f"{row.label} " + " -> ".join(f"{values[m.name][row.key]:.4f}" for m in results
                                          if row.key in values[m.name]) for row in report.rows]
    echo(f"held-out {', '.join(said)} ({'before -> after, ' if len(results) > 1 else ''}"
         f"{results[-1].details.get('examples', 0)} examples; {out / OUT_DIR})")
    return values


def measure_column(backend, col: Column, datasets: list, options, handle=None):
    """One model on every held-out set (loaded unless given), then freed; the sets' results combined."""
    from .suite import measure

    started = time.perf_counter()
    if handle is None:
        handle = col.load(backend, options.precision)
    parts = [measure(backend, handle, col, ds, options) for ds in datasets]
    del handle
    gc.collect()
    result = functools.reduce(combine, parts)
    result.seconds = time.perf_counter() - started
    return result


def heldout_sets(cfg) -> list:
    """The run's held-out sets as the suite reads them, at most eval.max_samples records in all."""
    left = cfg.eval.max_samples
    out = []
    for spec in cfg.data.val_datasets:
        if left is not None and left <= 0:
            break
        caps = [n for n in (spec.num_samples, left) if n is not None]
        ds = load_dataset(cfg, spec.model_copy(update={"num_samples": min(caps) if caps else None}))
        out.append(ds)
        if left is not None:
            left -= len(ds.records)
    return out


def trained_column(cfg) -> Column:
    out = Path(cfg.output_dir)
    if cfg.adapter.type == "none":
        model = cfg.model.model_copy(update={"base_model": str(out)})
        return Column("after", str(out), "run", cfg.model_copy(update={"model": model}), None, cfg.model.base_model)
    return Column("after", str(out), "run", cfg, out, cfg.model.base_model)


def starting_column(cfg) -> Column:
    """The model the run started from: the base, with the adapter it was initialised from if any
    (a full fine-tune's base_model already names its starting weights)."""
    start = cfg.adapter.init_from
    if cfg.adapter.type != "none" and start:
        return Column("before", str(start), "adapter", cfg, Path(start).expanduser(), cfg.model.base_model)
    kind = "base" if cfg.adapter.type != "none" else "model"
    return Column("before", cfg.model.base_model, kind, cfg, None, cfg.model.base_model)


def combine(a, b):
    """Two measurements of one model on two held-out sets: each value weighted by its examples."""
    na, nb = a.details.get("examples", 0), b.details.get("examples", 0)
    values = {k: (a.values[k] * na + b.values[k] * nb) / max(na + nb, 1)
              if a.values.get(k) is not None and b.values.get(k) is not None else a.values.get(k)
              for k in a.values}
    details = {**a.details, "examples": na + nb}
    for key in ("voice_fidelity_per_example",):
        details[key] = a.details.get(key, []) + b.details.get(key, [])
    lowest = sorted(a.details.get("voice_fidelity_lowest", []) + b.details.get("voice_fidelity_lowest", []),
                    key=lambda row: row["similarity"])[: voice.LOWEST]
    details["voice_fidelity_lowest"] = lowest
    return replace(a, values=values, details=details, answers=a.answers or b.answers,
                   seconds=a.seconds + b.seconds)
