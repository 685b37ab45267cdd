"""Curricula: several runs one after another, each carrying the adapter on, switching data, method and
backend by config alone.

A curriculum is a run config with a `stages:` list. The keys at the top are
the defaults; each stage overrides some of them (its data above all: a
topic), then runs as an ordinary run in `output_dir/stage-N-name/`:

    model: {base_model: smollm2-135m-instruct}
    adapter: {type: lora, r: 16, alpha: 32}
    data: {sequence_len: 256}
    training: {max_steps: 30, learning_rate: 5.0e-4}
    preference: {type: orpo}
    output_dir: outputs/curriculum
    stages:
      - name: lights
        data: {datasets: [{path: lights.jsonl}]}
      - name: voice
        method: preference
        backend: mlx
        data: {datasets: [{path: voice_pairs.jsonl}]}

Stage N+1 starts from stage N's adapter (`adapter.init_from`, PEFT format,
which every backend reads, so torch -> mlx -> torch just works), or, in full
fine-tuning, from stage N's saved model. Each stage is checked whole before
anything trains, problems named by stage (`stages.1.backend: ...`). A
finished stage is never run again; an interrupted one resumes from its
newest checkpoint (or starts over when it had none). After every stage its
held-out numbers (and, with `eval.voice_fidelity`, the voice fidelity of its
answers before and after, evaluation/trained.py) join `curriculum.json` and
`curriculum.md`, with a PNG per metric across stages (`curriculum_<metric>.png`,
when matplotlib is installed).
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from ..config import ConfigError, Issue, RunConfig, _missing_files, _pydantic_issues, _read_yaml, read_source
from ..configure import SCHEMA_CHECKS
from ..errors import MudpuppyError, OutputExists
from ..evaluation import trained
from ..files import write_json_atomic
from ..output_dir import rundir
from ..output_dir.claim import check_overwrite_target

STATE = "curriculum.json"
REPORT = "curriculum.md"
CHART = "curriculum_{}.png"
# What a stage may change; the model and adapter carry through, the output directory is the curriculum's.
STAGE_KEYS = {"name", "method", "backend", "devices", "data", "training", "eval", "preference", "grpo", "rloo", "online_dpo", "distill",
              "memory", "logging", "merge", "merge_dtype"}
CARRIED = {"model": "the model carries through the curriculum", "adapter": "the adapter carries through the curriculum",
           "output_dir": "each stage writes to output_dir/stage-N-name", "stages": "stages do not nest",
           "resume": "a curriculum resumes by itself (run it again)", "reward": "reward models are not stages"}
# Method sections: kept for the stages whose method reads them, dropped for the others.
SECTIONS = {"preference": {"preference"}, "grpo": {"grpo"}, "rloo": {"rloo"}, "online_dpo": {"online_dpo"},
            "distill": {"distill"}, "reward": {"rm", "prm"}}
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class Stage:
    index: int                    # 1-based
    name: str
    cfg: RunConfig
    dir: Path

    @property
    def label(self) -> str:
        return f"stage-{self.index}-{self.name}"


@dataclass
class Curriculum:
    origin: str
    output_dir: Path
    stages: list[Stage]


@dataclass
class CurriculumResult:
    output_dir: Path
    rows: list[dict] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)        # stages trained by this call (the others were done)


def is_curriculum(source) -> bool:
    raw = source if isinstance(source, dict) else _read_yaml(Path(source))
    return isinstance(raw, dict) and "stages" in raw


def load_curriculum(source, overrides: list[str] | tuple[str, ...] = (), check_files: bool = True) -> Curriculum:
    """Read a curriculum (a YAML file or a dict), apply overrides, and check every stage whole."""
    raw, origin, source_dir, issues = read_source(source, overrides)
    stages = raw.pop("stages", None)
    if not isinstance(stages, list) or not stages or not all(isinstance(s, dict) for s in stages):
        issues.append(Issue("stages", "expected a list of stages, each a mapping (at least one)"))
    if "output_dir" not in raw:
        issues.append(Issue("output_dir", "required key is missing (the curriculum's directory)"))
    if issues:
        raise ConfigError(origin, [str(i) for i in issues])
    out = Path(raw["output_dir"])
    built, names = [], set()
    for i, stage in enumerate(stages):
        where = f"stages.{i}"
        name = str(stage.get("name", f"stage{i + 1}"))
        if not NAME.match(name):
            issues.append(Issue(f"{where}.name", f"{name!r}: letters, digits, '-', '_' and '.' only (it names a directory)"))
        elif name in names:
            issues.append(Issue(f"{where}.name", f"{name!r} names another stage too"))
        names.add(name)
        wrong = [k for k in stage if k not in STAGE_KEYS]
        for key in wrong:
            issues.append(Issue(f"{where}.{key}", CARRIED.get(key, "not a key a stage can set; a stage sets "
                                                                   + ", ".join(sorted(STAGE_KEYS)))))
        if wrong:
            continue
        merged = _merge(raw, {k: v for k, v in stage.items() if k != "name"})
        method = merged.get("method", "sft")
        if method in ("rm", "prm"):
            issues.append(Issue(f"{where}.method", f"{method}: a reward model is a different model, not a stage of "
                                                   "this one's training; train it in a run of its own"))
            continue
        for section, methods in SECTIONS.items():
            if method not in methods:
                merged.pop(section, None)
        merged["output_dir"] = str(out / f"stage-{i + 1}-{name}")
        merged["source_dir"] = source_dir
        if i and built:
            _carry(merged, built[-1])
        try:
            cfg = RunConfig.model_validate(merged, context=SCHEMA_CHECKS)
        except ValidationError as exc:
            issues += [Issue(f"{where}.{i_.path}", i_.message) for i_ in _pydantic_issues(exc)]
            continue
        if check_files:
            issues += [Issue(f"{where}.{i_.path}", i_.message) for i_ in _missing_files(cfg)]
        issues += [Issue(f"{where}.{path}", message) for path, message in trained.check_trained_metrics(cfg)]
        built.append(Stage(i + 1, name, cfg, Path(cfg.output_dir)))
    if issues:
        raise ConfigError(origin, [str(i) for i in issues])
    return Curriculum(origin, out, built)


def _merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`: mappings merge key by key, anything else (lists included) is replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _carry(merged: dict, previous: Stage) -> None:
    """Start this stage where the previous one ended: its adapter, or in full fine-tuning its model."""
    adapter = merged.setdefault("adapter", {})
    if adapter.get("type", "lora") == "none":
        merged.setdefault("model", {})["base_model"] = str(previous.dir)
    else:
        adapter["init_from"] = str(previous.dir)


# --------------------------------------------------------------------------- running
def run_curriculum(cur: Curriculum, overwrite: bool = False, echo=print, backend_for=None,
                   allow_changes: bool = False) -> CurriculumResult:
    """Run the stages not finished yet, in order. `backend_for(cfg)` makes each stage's backend
    (default: create_backend from the stage's config, so a stage can switch runtimes). `allow_changes`: a
    stage resumed with other settings than its checkpoint's goes on, recording them (training.run)."""
    from ..backends import create_backend
    from ..distributed import launched

    if launched():
        raise MudpuppyError("a curriculum runs in one process for now; start it without --nproc / torchrun")
    out = _check_dir(cur, overwrite)
    with rundir.locked(out):            # a second process on this curriculum stops here, naming this one
        _prepare(cur, overwrite)
        return _run_stages(cur, out, echo, backend_for or (lambda cfg: create_backend(cfg.backend,
                                                                                      **cfg.backend_options())),
                           allow_changes)


def _run_stages(cur: Curriculum, out: Path, echo, backend_for, allow_changes: bool = False) -> CurriculumResult:
    from . import run as run_one
    from .checkpoints import newest_checkpoint

    result = CurriculumResult(out)
    state = _read_state(out)
    rows = state.get("stages", [])
    for stage in cur.stages:
        # After --overwrite a stage's earlier run is replaced (by the stage's own --overwrite, once its model
        # and data load), never skipped or resumed, even when the curriculum is run again after a crash.
        old = _replaced(stage.dir, state.get("replaced_before"))
        done = stage.dir / rundir.SUMMARY
        if done.is_file() and not old:
            echo(f"== {stage.label}: finished earlier, skipped")
            if trained.trained_metrics(stage.cfg) and not trained.is_measured(stage.dir):
                # stopped between training and its measurement: measure what the stage saved
                trained.measure_trained(stage.cfg, backend_for(stage.cfg), echo=echo)
                rows = _with_row(rows, _row(stage, _ran_on(rows, stage)))
                _write_state(out, cur, rows, finished=False)
            continue
        checkpoint = newest_checkpoint(stage.dir) if stage.dir.is_dir() and not old else None
        cfg = stage.cfg.model_copy(update={"resume": True}) if checkpoint else stage.cfg
        backend = backend_for(cfg)
        echo(f"== {stage.label}: {_describe(cfg)} on {backend.name}"
             + (f", resuming from {checkpoint.name}" if checkpoint else ""))
        # A stage that died before its first checkpoint starts over; its directory is one of ours.
        try:
            finished = run_one(cfg, backend, overwrite=checkpoint is None and stage.dir.exists(), echo=echo,
                               allow_changes=allow_changes)
        finally:
            rundir.end_run(stage.dir)      # the stage's lock, also when it failed (the curriculum keeps its own)
        if trained.trained_metrics(cfg):
            trained.measure_trained(cfg, backend, finished, echo=echo)     # the trained model, then the start
        del finished
        rows = _with_row(rows, _row(stage, backend.name))
        _write_state(out, cur, rows, finished=False)
        result.ran.append(stage.label)
    ran_on = {r["stage"]: r["backend"] for r in rows}
    rows = [_row(stage, ran_on.get(stage.index, stage.cfg.backend)) for stage in cur.stages]
    _write_state(out, cur, rows, finished=True)
    result.rows = rows
    echo(report_table(rows))
    return result


def _replaced(stage_dir: Path, before: float | None) -> bool:
    """Whether the stage's directory holds a run from before the curriculum's --overwrite."""
    if before is None or not rundir.entries(stage_dir):
        return False
    marker = rundir.read_marker(stage_dir)
    return marker is None or marker.get("created_at", 0) < before


def _with_row(rows: list[dict], row: dict) -> list[dict]:
    return sorted([r for r in rows if r["stage"] != row["stage"]] + [row], key=lambda r: r["stage"])


def _ran_on(rows: list[dict], stage: Stage) -> str:
    return next((r["backend"] for r in rows if r["stage"] == stage.index), stage.cfg.backend)


def _describe(cfg: RunConfig) -> str:
    method = cfg.data_method() if cfg.method == "preference" else cfg.method
    data = ", ".join(Path(d.path).name for d in cfg.data.datasets)
    return f"{method}, {cfg.adapter.type}, data {data}"


def _check_dir(cur: Curriculum, overwrite: bool) -> Path:
    """Refusals that need no lock (nothing is written): the directory is a file, is not a curriculum, or is
    one --overwrite never replaces (output_dir.claim.check_overwrite_target, against every stage's files)."""
    out = cur.output_dir
    if out.exists() and not out.is_dir():
        raise OutputExists(f"output_dir {out} is a file, not a directory")
    if overwrite:
        for stage in cur.stages:
            check_overwrite_target(out, stage.cfg, inside=[s.dir for s in cur.stages])
    if rundir.entries(out) and not (out / STATE).is_file():
        if overwrite:
            raise OutputExists(f"output_dir {out} is not empty and holds no {STATE}; refusing to clear it even "
                               "with --overwrite")
        raise OutputExists(f"output_dir {out} already holds files that are not a curriculum; choose another "
                           "output_dir")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _prepare(cur: Curriculum, overwrite: bool) -> None:
    """Under the curriculum's lock: what a run of it does with what the directory holds.

    --overwrite removes nothing here: each stage replaces its own earlier run when it starts (only what that
    run wrote, once the stage's model and data have loaded); `replaced_before` tells the stages which runs
    are the earlier ones, also when the curriculum is run again after a crash.
    """
    import time

    out = cur.output_dir
    if (out / STATE).is_file():
        if overwrite:
            _write_state(out, cur, [], finished=False, replaced_before=time.time())
            return
        if _read_state(out).get("status") == "finished":
            raise OutputExists(f"output_dir {out} holds a finished curriculum; pass --overwrite to run it again "
                               "from the start, or choose another output_dir")
        stored = _read_state(out).get("stages_planned")
        planned = [s.label for s in cur.stages]
        if stored and stored != planned:
            raise OutputExists(f"output_dir {out} holds an unfinished curriculum with other stages ({stored}); "
                               f"this one has {planned}; use another output_dir or --overwrite")
    else:
        _write_state(out, cur, [], finished=False)


def _read_state(out: Path) -> dict:
    try:
        return json.loads((out / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _row(stage: Stage, backend: str) -> dict:
    """One stage's line of the report: what it ran, where, and its held-out numbers before and after."""
    summary = json.loads((stage.dir / rundir.SUMMARY).read_text(encoding="utf-8"))
    suite = trained.read_measured(stage.dir)       # eval.voice_fidelity: before and after the stage
    return {"stage": stage.index, "name": stage.name, "method": _describe(stage.cfg).split(",")[0],
            "backend": backend, "steps": summary.get("steps"), "final_loss": summary.get("final_loss"),
            "seconds": summary.get("seconds"), "dir": str(stage.dir),
            "before": {**_numbers(summary.get("eval_before")), **suite.get("before", {})},
            "after": {**_numbers(summary.get("eval_after")), **suite.get("after", {})}}


def _numbers(evaluation: dict | None) -> dict:
    """A stage's held-out numbers by name: loss, then the method's metrics (named once: an accuracy that is
    also one of the metrics appears under the metric's name)."""
    out = {}
    for key, value in (evaluation or {}).items():
        if isinstance(value, dict):
            out.update({k: v for k, v in value.items() if _is_number(v)})
        elif _is_number(value) and key not in ("samples", "accuracy"):
            out[key] = value
    accuracy, name = (evaluation or {}).get("accuracy"), (evaluation or {}).get("accuracy_name")
    if _is_number(accuracy) and name and name not in out:
        out[name] = accuracy
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _write_state(out: Path, cur: Curriculum, rows: list[dict], finished: bool, replaced_before=None) -> None:
    previous = _read_state(out)
    charts = previous.get("charts")
    if not (charts and _same(previous.get("stages"), rows) and all((out / c).is_file() for c in charts)):
        charts = write_charts(rows, out)           # only when the numbers changed: a chart takes ~0.3 s
    state = {"status": "finished" if finished else "running", "config": cur.origin,
             "stages_planned": [s.label for s in cur.stages], "stages": rows, "charts": charts or []}
    replaced_before = replaced_before or previous.get("replaced_before")
    if replaced_before:
        state["replaced_before"] = replaced_before
    write_json_atomic(out / STATE, state)
    tmp = out / (REPORT + ".tmp")
    tmp.write_text(report_markdown(rows, charts or []), encoding="utf-8")
    os.replace(tmp, out / REPORT)


def _same(stored, rows: list[dict]) -> bool:
    return json.dumps(stored, sort_keys=True) == json.dumps(rows, sort_keys=True)


def _metric_names(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r["after"]))


def report_markdown(rows: list[dict], charts: list[str] = ()) -> str:
    names = _metric_names(rows)
    head = ["stage", "name", "method", "backend", "steps", *names]
    lines = ["# Curriculum", "", "Held-out numbers after each stage, on the stage's own held-out set "
             "(before -> after the stage's training).", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["stage"]), r["name"], r["method"], r["backend"], str(r["steps"])]
        cells += [f"{_fmt(r['before'].get(n))} -> {_fmt(r['after'].get(n))}" if n in r["before"]
                  else _fmt(r["after"].get(n)) for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    if charts:
        lines += [""] + [f"![{name}]({name})" for name in charts]
    return "\n".join(lines) + "\n"


def chart_file(metric: str) -> str:
    return CHART.format(re.sub(r"[^A-Za-z0-9_.-]+", "_", metric))


def write_charts(rows: list[dict], out: Path) -> list[str] | None:
    """curriculum_<metric>.png for each metric: its value after each stage (and before it, hollow), stage
    by stage; None when matplotlib is not installed (the rest of the report is written all the same)."""
    try:
        from matplotlib.figure import Figure     # no pyplot: no GUI backend, no global state
    except ImportError:
        return None
    labels = [f"{r['stage']} {r['name']}\n{r['method']}, {r['backend']}" for r in rows]
    written = []
    for name in _metric_names(rows):
        fig = Figure(figsize=(max(4.5, 1.6 * len(rows) + 1.5), 3.4), layout="constrained")
        ax = fig.add_subplot()
        x = list(range(len(rows)))
        after = [r["after"].get(name) for r in rows]
        before = [r["before"].get(name) for r in rows]
        if any(v is not None for v in before):
            ax.plot([i for i, v in zip(x, before) if v is not None], [v for v in before if v is not None], "o",
                    mfc="none", color="#8c8c8c", label="before the stage")
        ax.plot([i for i, v in zip(x, after) if v is not None], [v for v in after if v is not None], "o-",
                color="#4c72b0", label="after the stage")
        for i, v in zip(x, after):
            if v is not None:
                ax.annotate(_fmt(v), (i, v), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_title(f"{name} across stages (each on its stage's held-out set)", fontsize=10)
        ax.margins(x=0.15, y=0.2)
        ax.spines[["top", "right"]].set_visible(False)
        ax.legend(fontsize=8, frameon=False)
        fig.savefig(out / chart_file(name), dpi=120)
        written.append(chart_file(name))
    return written


def report_table(rows: list[dict]) -> str:
    names = _metric_names(rows)
    head = ["stage", "name", "method", "backend", *names]
    body = [[str(r["stage"]), r["name"], r["method"], r["backend"], *[_fmt(r["after"].get(n)) for n in names]]
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in [head, *body]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)
