"""lm-evaluation-harness tasks (`mudpuppy eval --tasks`), through its Python API, on the model the suite
already loaded: the adapter attached, at the evaluation's precision.

    check_tasks    lm-eval installed, --include-path a directory, every task found and loadable
                   (datasets read or downloaded)                               before any model loads
    run_tasks      HFLM around the loaded transformers model and tokenizer, lm_eval.simple_evaluate,
                   each task's metrics as table rows ("arc_easy acc", ...)

Torch backends only: lm-eval's HFLM drives a transformers model. Local YAML tasks (a directory of
*.yaml given with --include-path, over local files) run offline. When every task named is found in
--include-path, lm-eval's ~15k built-in task configs are not indexed (that takes ~25 s here).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MudpuppyError
from .metrics import Row

INSTALL = "pip install 'mudpuppy[lmeval]'"


class TaskError(MudpuppyError):
    """--tasks / --include-path problems, found before any model loads."""


@dataclass
class TaskPlan:
    names: list[str]
    include_path: str | None
    manager: object = field(repr=False, default=None)      # lm_eval.tasks.TaskManager, indexed once


@dataclass
class TaskResults:
    rows: list[Row]
    values: dict[str, float]
    details: dict


def parse_tasks(text: str) -> list[str]:
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise TaskError("--tasks: no task named; give NAME[,NAME...] (lm-eval task, group or tag names, or "
                        "paths of task YAML files)")
    return names


def check_tasks(names: list[str], include_path: str | None) -> TaskPlan:
    if importlib.util.find_spec("lm_eval") is None:
        raise TaskError(f"--tasks needs lm-evaluation-harness, which is not installed; install the lmeval extra: "
                        f"{INSTALL}")
    if include_path is not None:
        path = Path(include_path).expanduser()
        if not path.is_dir():
            what = "a file, not a directory" if path.exists() else f"no such directory ({path.resolve()})"
            raise TaskError(f"--include-path {include_path}: {what}; give the directory that holds the task YAML "
                            "files")
    local = str(Path(include_path).expanduser()) if include_path else None
    with quiet_lm_eval():
        from lm_eval.tasks import TaskManager

        # Indexing lm-eval's own ~15k task configs takes ~25 s: skipped when the local ones hold every task.
        manager = TaskManager(include_path=local, include_defaults=False) if local else None
        if manager is None or not all(known(manager, n) for n in names):
            manager = TaskManager(include_path=local)
    unknown = [n for n in names if not known(manager, n)]
    if unknown:
        import difflib

        hints = {n: difflib.get_close_matches(n, manager.all_tasks, n=3) for n in unknown}
        said = "; ".join(f"{n!r}" + (f" (did you mean {', '.join(h)}?)" if h else "") for n, h in hints.items())
        where = (f"lm-eval's tasks or {include_path}" if local
                 else "lm-eval's tasks (local YAML tasks: --include-path DIR)")
        raise TaskError(f"--tasks: unknown task {said}; not among {where}")
    plan = TaskPlan(names, include_path, manager)
    load_tasks(plan)           # reads (or downloads) the datasets now, so a bad task fails before a model loads
    _PLANS[(tuple(names), include_path)] = plan
    return plan


_PLANS: dict[tuple, TaskPlan] = {}


def plan_for(names: list[str], include_path: str | None) -> TaskPlan:
    """The checked plan of these tasks (indexed once per process: every column of an evaluation shares it)."""
    return _PLANS.get((tuple(names), include_path)) or check_tasks(names, include_path)


def known(manager, name: str) -> bool:
    path = Path(name).expanduser()
    return name in manager.all_tasks or (path.is_file() and path.suffix in (".yaml", ".yml"))


def load_tasks(plan: TaskPlan) -> dict:
    try:
        with quiet_lm_eval():
            load = getattr(plan.manager, "load", None) or plan.manager.load_task_or_group   # older lm-eval
            return load(plan.names)
    except Exception as exc:        # lm-eval and datasets raise many kinds: name the task, keep the cause
        raise TaskError(f"--tasks {','.join(plan.names)}: lm-eval could not load the task "
                        f"({type(exc).__name__}: {exc}); a local task's data_files are read relative to the "
                        "current directory") from None


def check_backend(backend) -> None:
    if not backend.transformers_model:
        raise TaskError(f"--tasks: lm-evaluation-harness drives a transformers (torch) model, and this evaluation "
                        f"runs on {backend.name}; pass --backend cpu (or cuda, rocm) to run the tasks")


def run_tasks(backend, handle, plan: TaskPlan, batch_size: int, limit: int | None,
              chat_template: bool = False) -> TaskResults:
    """Every task on the loaded model (its adapter on), lm-eval's metrics as rows."""
    check_backend(backend)
    with quiet_lm_eval():
        import lm_eval
        from lm_eval.models.huggingface import HFLM

        extra = {}
        if getattr(handle, "autocast_dtype", None) is not None:    # --precision bf16/fp16/auto: as measured here
            extra["mixed_precision_dtype"] = handle.autocast_dtype
        lm = HFLM(pretrained=handle.model, tokenizer=handle.tokenizer, batch_size=batch_size, **extra)
        results = lm_eval.simple_evaluate(lm, tasks=plan.names, task_manager=plan.manager, limit=limit,
                                          log_samples=False, apply_chat_template=chat_template)
    return task_results(results)


def task_results(results: dict) -> TaskResults:
    """lm-eval's results dict as rows ("task metric", filter in brackets when not "none"), values and
    details (stderr, samples, n-shot and version per task)."""
    rows, values, details = [], {}, {}
    better = results.get("higher_is_better", {})
    for task, measured in results.get("results", {}).items():
        info = {"metrics": {}, "stderr": {}}
        for key, value in measured.items():
            if "," not in key or not is_number(value):
                continue
            metric, filt = key.split(",", 1)
            if metric.endswith("_stderr"):
                info["stderr"][metric.removesuffix("_stderr") + ("" if filt == "none" else f",{filt}")] = value
                continue
            suffix = "" if filt == "none" else f":{filt}"
            row = Row(f"{task}:{metric}{suffix}", f"{task} {metric}" + ("" if filt == "none" else f" ({filt})"),
                      "number", bool(better.get(task, {}).get(metric, True)))
            rows.append(row)
            values[row.key] = float(value)
            info["metrics"][metric + ("" if filt == "none" else f",{filt}")] = float(value)
        samples = results.get("n-samples", {}).get(task)
        if samples:
            info["samples"] = samples.get("effective")
        if task in results.get("n-shot", {}):
            info["n_shot"] = results["n-shot"][task]
        if task in results.get("versions", {}):
            info["version"] = results["versions"][task]
        details[task] = info
    return TaskResults(rows, values, details)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@contextlib.contextmanager
def quiet_lm_eval():
    """lm-eval logs every step at INFO and warns about a model passed as an object (which is what we
    mean to do); only its errors are shown."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
