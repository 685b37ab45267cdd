"""Runs started, stopped and resumed from the page: each one a `mudpuppy` child process, the same command a
terminal would run, so the lock, the output rules and the validation are the command line's own.

    new run from a config   mudpuppy run CONFIG --set output_dir=RUNS_DIR/NAME --set KEY=VALUE ...
    new run from the form   mudpuppy train MODEL DATA --method M --output RUNS_DIR/NAME --max-steps N ...
    stop                    SIGINT to the process training there (what Ctrl-C sends: the step in progress
                            ends and its checkpoint is written)
    resume                  the command that started it again with --resume (a run the page did not start:
                            mudpuppy run RUN/config.yaml --resume --set output_dir=RUN)

The form is checked as it is filled by the function each verb calls first (configure.load_config, after
shortcuts.train_config for the form's fields), and a problem is shown as the terminal shows it
(`error: ...`). A child runs in its own session, so it survives a page reload and the UI's own Ctrl-C; its
output goes to RUNS_DIR/.mudpuppy-ui/logs/, its command and exit code to RUNS_DIR/.mudpuppy-ui/jobs/.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import MudpuppyError
from ..files import write_json_atomic
from .runs import UI_DIR, OutsideFolder, find_configs, inside, lock_holder, relative_name

# The form's fields that become `mudpuppy train` flags (new runs) or --set overrides (runs from a config).
FLAGS = {"max_steps": ("--max-steps", "training.max_steps", int),
         "learning_rate": ("--learning-rate", "training.learning_rate", float),
         "batch_size": ("--batch-size", "training.micro_batch_size", int),
         "sequence_len": ("--sequence-len", "data.sequence_len", int),
         "save_steps": ("--save-steps", "training.save_steps", int),
         "eval_steps": ("--eval-steps", "training.eval_steps", int),
         "seed": ("--seed", "training.seed", int)}
BACKEND_LINE = re.compile(r"backend: (\S+) on (.+)$")
BACKENDS = ("auto", "cpu", "cuda", "rocm", "mlx")


class FormError(MudpuppyError):
    """A form field the page sent that no verb could take (a path outside the folder, a number that is not)."""


@dataclass
class Plan:
    """What a filled form starts: the child's arguments after `mudpuppy`, and the run folder."""
    args: list[str]
    out: Path
    backend: str


def plan(root: Path, form: dict) -> Plan:
    """The form as a command, its values checked as the verb will check them; FormError / the verb's own
    MudpuppyError (with the message `mudpuppy validate` / `mudpuppy train` print) when one is wrong."""
    from ..configure import load_config

    name = str(form.get("output") or "").strip()
    if not name:
        raise FormError("output: name the run's folder (inside the runs folder)")
    try:
        out = inside(root, name)
    except OutsideFolder as exc:
        raise FormError(f"output: {exc}") from None
    if out == Path(os.path.realpath(root)):
        raise FormError("output: name a folder inside the runs folder, not the runs folder itself")
    backend = str(form.get("backend") or "auto")
    if backend not in BACKENDS:
        raise FormError(f"backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    values = {}
    for key, (_, _, kind) in FLAGS.items():
        raw = form.get(key)
        if raw in (None, ""):
            continue
        try:
            values[key] = kind(raw)
        except (TypeError, ValueError):
            raise FormError(f"{key}: {raw!r} is not {'a whole number' if kind is int else 'a number'}") from None
    if form.get("source") == "config":
        try:
            config = inside(root, str(form.get("config") or ""))
        except OutsideFolder as exc:
            raise FormError(f"config: {exc}") from None
        if config.suffix not in (".yaml", ".yml") or not config.is_file():
            raise FormError(f"config: {form.get('config')!r} is not a YAML file in the runs folder")
        overrides = [f"output_dir={out}", f"backend={backend}"] + [f"{FLAGS[k][1]}={v}" for k, v in values.items()]
        load_config(config, overrides)           # what `mudpuppy validate CONFIG --set ...` runs
        args = ["run", str(config)] + [a for o in overrides for a in ("--set", o)]
        return Plan(args, out, backend)
    from ..shortcuts import train_config

    model, data = str(form.get("model") or "").strip(), str(form.get("data") or "").strip()
    method = str(form.get("method") or "lora")
    if not model:
        raise FormError("model: name a base model (a Hub id, an alias or a local folder)")
    if not data:
        raise FormError("data: name a training data file")
    val = str(form.get("val_data") or "").strip() or None
    raw = train_config(model, data, method, str(out), val_data=val, backend=backend, **values)
    load_config(raw)                             # what `mudpuppy train` runs on the flags
    args = ["train", model, data, "--method", method, "--output", str(out), "--backend", backend]
    args += ["--val-data", val] if val else []
    for key, value in values.items():
        args += [FLAGS[key][0], str(value)]
    return Plan(args, out, backend)


def check(root: Path, form: dict) -> dict:
    """The form checked: {"ok": True, "message": the verb's ok line} or {"ok": False, "message": "error: ..."},
    as the terminal would print it."""
    try:
        p = plan(root, form)
    except MudpuppyError as exc:
        return {"ok": False, "message": f"error: {exc}"}
    return {"ok": True, "message": f"ok: mudpuppy {' '.join(p.args)}"}


class Jobs:
    """The processes the page started, and their records under RUNS_DIR/.mudpuppy-ui/."""

    def __init__(self, root: Path, python: str = sys.executable):
        self.root = Path(os.path.realpath(root))
        self.python = python
        self.lock = threading.Lock()
        self.children: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------ records
    def _paths(self, run: str) -> tuple[Path, Path]:
        key = run.replace("/", "__")
        return self.root / UI_DIR / "jobs" / f"{key}.json", self.root / UI_DIR / "logs" / f"{key}.log"

    def record(self, run: str) -> dict | None:
        try:
            data = json.loads(self._paths(run)[0].read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def started(self) -> list[str]:
        """The runs the page started (their folders may not be runs yet: the process is starting)."""
        folder = self.root / UI_DIR / "jobs"
        found = [self.record(p.stem.replace("__", "/")) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []
        return [job["run"] for job in found if job and isinstance(job.get("run"), str)]

    def log_path(self, run: str) -> Path:
        return self._paths(run)[1]

    # ------------------------------------------------------------------ actions
    def start(self, form: dict) -> dict:
        p = plan(self.root, form)
        if p.out.exists() and any(p.out.iterdir()):
            raise FormError(f"output: {relative_name(self.root, p.out)} already holds files; choose another name "
                            "(a stopped run is resumed from its own page)")
        return self._spawn(relative_name(self.root, p.out), p.args, p.backend, resume=False)

    def resume(self, run: str) -> dict:
        folder = inside(self.root, run)
        if lock_holder(folder) is not None:
            raise FormError(f"{run}: it is training now")
        job = self.record(run)
        if job is not None and isinstance(job.get("args"), list):
            args = [a for a in job["args"] if a != "--resume"] + ["--resume"]
        else:
            args = ["run", str(folder / "config.yaml"), "--resume", "--set", f"output_dir={folder}"]
        return self._spawn(run, args, (job or {}).get("backend"), resume=True)

    def stop(self, run: str) -> dict:
        """SIGINT to the process training in `run` (once: a second would stop it at once, without saving)."""
        folder = inside(self.root, run)
        pid = lock_holder(folder)
        if pid is None:
            raise FormError(f"{run}: nothing is training there")
        child = self.children.get(run)
        if (child is None or child.pid != pid) and not _is_mudpuppy(pid):
            raise FormError(f"{run}: its lock names pid {pid}, which is not a mudpuppy process; not signalled")
        os.kill(pid, signal.SIGINT)
        return {"run": run, "pid": pid, "signal": "SIGINT"}

    def _spawn(self, run: str, args: list[str], backend: str | None, resume: bool) -> dict:
        record_path, log_path = self._paths(run)
        for folder in (record_path.parent, log_path.parent):
            folder.mkdir(parents=True, exist_ok=True)
        with self.lock:
            running = self.children.get(run)
            if running is not None and running.poll() is None:
                raise FormError(f"{run}: the page's process for it is still running (pid {running.pid})")
            child = spawn(self.python, args, log_path)
            self.children[run] = child
        job = {"run": run, "args": args, "backend": backend, "pid": child.pid, "started": time.time(),
               "resumed": resume, "exit_code": None}
        write_json_atomic(record_path, job)
        threading.Thread(target=self._reap, args=(run, child, job), daemon=True).start()
        return job

    def _reap(self, run: str, child: subprocess.Popen, job: dict) -> None:
        code = child.wait()
        record_path, _ = self._paths(run)
        write_json_atomic(record_path, {**job, "exit_code": code, "ended": time.time()})

    def device(self, run: str) -> tuple[str, str] | None:
        """(backend, device) as the run's own first line in its log says them ("backend: cpu on cpu")."""
        try:
            with self.log_path(run).open(encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    match = BACKEND_LINE.match(line.strip())
                    if match:
                        return match.group(1), match.group(2)
        except OSError:
            pass
        return None

    def configs(self) -> list[str]:
        return find_configs(self.root)


def spawn(python: str, args: list[str], log_path: Path) -> subprocess.Popen:
    """`mudpuppy ARGS` as a child in its own session (a page reload or the page's Ctrl-C leaves it running),
    its output appended to `log_path` after the command line it runs."""
    with log_path.open("ab") as log:
        log.write(f"\n$ mudpuppy {' '.join(args)}\n".encode())
        log.flush()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        return subprocess.Popen([python, "-m", "mudpuppy.cli", *args], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _is_mudpuppy(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b"mudpuppy" in cmdline
