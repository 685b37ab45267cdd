"""Exports and evaluations started from the page: `mudpuppy export` and `mudpuppy eval` as child processes,
the command lines a terminal would type, so the output contract (output_dir/: a second export into the same
folder is refused with the CLI's own message unless --overwrite), the checks and the work are the command
line's own.

    export   mudpuppy export RUN --format F [--quant Q] [--dtype D] [--no-eval] [--overwrite]
             (written where the CLI writes it: RUN/export/<format>[-<quant>]; its path read from the child's
             own last line, "exported F to PATH: files")
    eval     mudpuppy eval RUN [RUN ...] --data FILE --out RUNS_DIR/.mudpuppy-ui/evals/ID [--max-samples N] [--base]
             (the table it prints rebuilt from the eval.json it writes, by report.table_cells, the CLI's own)

Each task's command, pid and exit code go to RUNS_DIR/.mudpuppy-ui/tasks/ID.json, its output to ID.log.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from ..files import write_json_atomic
from .jobs import FormError, spawn
from .runs import UI_DIR, OutsideFolder, inside, relative_name

EXPORTED = re.compile(r"^exported (\S+) to (.+?): (.+)$")
TASK_ID = re.compile(r"^(export|eval)-[0-9]{8}-[0-9]{6}-[0-9]+$")
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def export_choices() -> dict:
    """The formats and their quantizations, as `mudpuppy export --format/--quant` takes them."""
    from ..export import gguf, mlx
    from ..export.pipeline import DEFAULT_QUANT, FORMATS

    quants = list(gguf.QUANTS) + list(gguf.K_QUANTS)
    return {"formats": list(FORMATS), "quants": {"gguf": quants, "ollama": quants, "mlx": list(mlx.QUANTS),
                                                "merged": []},
            "defaults": dict(DEFAULT_QUANT)}


def _run_folder(root: Path, run: str, field: str = "run") -> Path:
    try:
        folder = inside(root, str(run or ""))
    except OutsideFolder as exc:
        raise FormError(f"{field}: {exc}") from None
    if not (folder / "config.yaml").is_file():
        raise FormError(f"{field}: {run!r} is not a run (no config.yaml)")
    return folder


def export_args(root: Path, body: dict) -> list[str]:
    """The `mudpuppy export` command for the page's export button, its options checked as the CLI checks them
    (export.pipeline.check_options: the same messages)."""
    from ..export.pipeline import check_options

    folder = _run_folder(root, body.get("run"))
    fmt = str(body.get("format") or "")
    quant = str(body.get("quant") or "") or None
    dtype = str(body.get("dtype") or "") or None
    check_options(fmt, dtype, quant)
    args = ["export", str(folder), "--format", fmt]
    args += ["--quant", quant] if quant else []
    args += ["--dtype", dtype] if dtype else []
    args += [] if body.get("evaluate", True) or fmt not in ("gguf", "ollama") else ["--no-eval"]
    args += ["--overwrite"] if body.get("overwrite") else []
    return args


def eval_args(root: Path, body: dict, out: Path) -> list[str]:
    """The `mudpuppy eval` command for the compare page's button: the ticked runs on one data file."""
    runs = body.get("runs")
    if not isinstance(runs, list) or not runs:
        raise FormError("runs: tick the runs to evaluate")
    folders = [_run_folder(root, r, "runs") for r in runs]
    try:
        data = inside(root, str(body.get("data") or ""))
    except OutsideFolder as exc:
        raise FormError(f"data: {exc}") from None
    if not data.is_file() or data.suffix.lower() not in DATA_SUFFIXES:
        raise FormError(f"data: {body.get('data')!r} is not a data file ({', '.join(DATA_SUFFIXES)}) in the runs folder")
    args = ["eval", *map(str, folders), "--data", str(data), "--out", str(out)]
    samples = body.get("max_samples")
    if samples not in (None, ""):
        try:
            samples = int(samples)
        except (TypeError, ValueError):
            raise FormError(f"max_samples: {samples!r} is not a whole number") from None
        if samples < 1:
            raise FormError("max_samples: at least 1")
        args += ["--max-samples", str(samples)]
    return args + (["--base"] if body.get("base") else [])


def eval_table(out: Path) -> dict | None:
    """The table `mudpuppy eval` printed, from the eval.json it wrote in `out` (report.table_cells)."""
    from ..evaluation.metrics import Row
    from ..evaluation.report import table_cells

    try:
        data = json.loads((out / "eval.json").read_text(encoding="utf-8"))
        rows = [Row(**r) for r in data["rows"]]
        models = [SimpleNamespace(name=m["name"], values=m["values"], target=m["target"]) for m in data["models"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    cells = table_cells(SimpleNamespace(rows=rows, models=models))
    return {"header": cells[0], "rows": cells[1:], "models": [m.name for m in models],
            "data": (data.get("data") or {}).get("path"), "out": str(out)}


def data_files(root: Path) -> list[str]:
    """Data files under the runs folder an evaluation may read: run folders' insides and the page's own
    folder left out (their .json and .jsonl files are records, not data)."""
    from .runs import MAX_DEPTH, SKIP, is_run

    base, found = Path(root), []

    def walk(folder: Path, depth: int) -> None:
        for path in sorted(folder.iterdir()):
            if path.is_file() and path.suffix.lower() in DATA_SUFFIXES:
                found.append(relative_name(base, path))
            elif path.is_dir() and not path.is_symlink() and path.name not in SKIP and depth < MAX_DEPTH \
                    and not is_run(path):
                walk(path, depth + 1)

    walk(base, 0)
    return found[:500]


class Tasks:
    """The exports and evaluations the page started, and their records under RUNS_DIR/.mudpuppy-ui/tasks/."""

    def __init__(self, root: Path, python: str = sys.executable):
        self.root, self.python = Path(root), python
        self.folder = self.root / UI_DIR / "tasks"
        self.lock = threading.Lock()
        self.count = itertools.count(1)

    def _new_id(self, kind: str) -> str:
        return f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{next(self.count)}"

    def export(self, body: dict) -> dict:
        args = export_args(self.root, body)
        return self._start(self._new_id("export"), args, run=relative_name(self.root, Path(args[1])))

    def evaluate(self, body: dict) -> dict:
        task = self._new_id("eval")
        out = self.root / UI_DIR / "evals" / task
        return self._start(task, eval_args(self.root, body, out), out=str(out))

    def _start(self, task: str, args: list[str], **extra) -> dict:
        self.folder.mkdir(parents=True, exist_ok=True)
        with self.lock:
            child = spawn(self.python, args, self.folder / f"{task}.log")
        record = {"id": task, "args": args, "pid": child.pid, "started": time.time(), "exit_code": None, **extra}
        write_json_atomic(self.folder / f"{task}.json", record)

        def reap() -> None:
            code = child.wait()
            write_json_atomic(self.folder / f"{task}.json", {**record, "exit_code": code, "ended": time.time()})

        threading.Thread(target=reap, daemon=True).start()
        return record

    def get(self, task: str) -> dict:
        """A task's record, its output so far, and its result once it has one: the export's path and files, or
        the evaluation's table; `error`, the CLI's own `error: ...` line, when it failed."""
        if not TASK_ID.match(str(task)):
            raise FormError(f"task {task!r}: no such task")
        try:
            record = json.loads((self.folder / f"{task}.json").read_text(encoding="utf-8"))
            log = (self.folder / f"{task}.log").read_text(encoding="utf-8", errors="replace")
        except (OSError, ValueError):
            raise FormError(f"task {task!r}: no such task") from None
        result: dict = {**record, "log": log[-32768:]}
        lines = log.splitlines()
        errors = [line for line in lines if line.startswith("error: ")]
        if record.get("exit_code") not in (None, 0) and errors:
            result["error"] = errors[-1]
        if record["args"][0] == "export":
            for line in lines:
                match = EXPORTED.match(line)
                if match:
                    out = Path(match.group(2))
                    result["path"] = str(out)
                    result["files"] = [f.strip() for f in match.group(3).split(",")]
                    result["exists"] = all((out / f).exists() for f in result["files"])
        elif record.get("exit_code") == 0:
            result["table"] = eval_table(Path(record["out"]))
        return result

    def of_run(self, run: str) -> list[dict]:
        """The run's exports the page started, newest first (a reloaded page shows them again)."""
        if not self.folder.is_dir():
            return []
        found = []
        for path in sorted(self.folder.glob("export-*.json"), reverse=True):
            try:
                record = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if record.get("run") == run:
                found.append(self.get(record["id"]))
        return found[:10]
