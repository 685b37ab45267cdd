"""What a resumed run changes: the config and data a checkpoint was trained with, against the config that
resumes it.

Every checkpoint records what trained it (`trained_with`: each config value by its dotted path, and the
sha256 of each local data file) and the changes accepted earlier in the run (`config_changes`), in its
complete.json. `--resume` compares the newest checkpoint's record with the config and data it is given,
before any model loads:

    fixed      the checkpoint's weights belong to the old value (base model, method, adapter shape,
               preference type): refused, whatever the flags
    trains     anything else that decides what is trained (optimizer, schedule, steps, batch sizes,
               seed, precision, data and its content, the method's loss settings): refused unless
               the user accepts it (`mudpuppy run --resume --allow-changes`, run(..., allow_changes=True))
    neutral    where and how the run is computed or what it reports (NEUTRAL): never refused

Accepted changes, neutral ones included, are the run's record from then on: a line in metrics.jsonl at
the step they took effect, `config_changes` in run_summary.json and in every later checkpoint. The run's
config.yaml keeps the config it started with (session.py), so it never claims a new value for the whole run.
"""

from __future__ import annotations

import contextlib
import json
import math
from contextvars import ContextVar
from pathlib import Path

import yaml

from ..config import bounded_yaml_load
from ..errors import MudpuppyError
from ..monitor.callbacks import Callback
from ..monitor.metrics import METRICS, MetricsFile
from . import checkpoints

RECORD = "trained_with"            # complete.json: what trained the checkpoint
HISTORY = "config_changes"         # complete.json and run_summary.json: the changes accepted so far
CONTENT = ".content"               # the suffix of a data file's digest among the settings
PROCESSES = "distributed.processes"   # how many processes trained: recorded beside the config's values

# How this invocation finds the run, not what it trains: never compared.
IGNORED = ("resume", "output_dir")
# Never refused: where the run is computed and how it fits (memory options are exact, docs/memory.md),
# what it measures, reports and keeps, and what happens after training.
NEUTRAL = ("backend", "devices", "logging", "eval", "merge", "merge_dtype", "memory",
           "training.save_steps", "training.keep_last_n", "training.eval_steps", "training.gradient_checkpointing",
           "training.compile", "training.deterministic", "distributed.strategy", "distributed.timeout_s",
           "distributed.reshard_after_forward", "distributed.cpu_offload", "data.cache", "data.cache_dir",
           "data.num_proc", "data.val_datasets", "grpo.log_completions", "rloo.log_completions",
           "online_dpo.log_completions", "model.trust_remote_code")
# The global batch is their product (docs/distributed.md: the loss is divided over the whole of it): they
# change training unless the product stays, as when 2 processes at micro batch 2 resume in 1 at 4.
BATCH = ("training.micro_batch_size", "training.gradient_accumulation_steps", PROCESSES)
# ... except these, when early stopping is on: they decide when the run stops.
STOPPING = ("training.eval_steps", "eval.max_samples", "eval.max_new_tokens", "data.val_datasets")
# What a checkpoint's weights (loop.checkpoint_identity) and optimizer state (the backend refuses another
# optimizer's) belong to: no flag changes these.
FIXED = ("model.base_model", "method", "adapter", "preference.type", "training.optimizer")
UNFIXED = ("adapter.dropout",)     # dropout draws masks; the weights' shape is the same

_ALLOWED: ContextVar[bool] = ContextVar("mudpuppy_allow_changes", default=False)


@contextlib.contextmanager
def allowing(allowed: bool = True):
    """Within this block a resumed run continues with changed settings (recorded) instead of refusing them:
    what `--allow-changes` and run(..., allow_changes=True) set."""
    token = _ALLOWED.set(bool(allowed))
    try:
        yield
    finally:
        _ALLOWED.reset(token)


def changes_allowed() -> bool:
    return _ALLOWED.get()


# --------------------------------------------------------------------------- what trained a run

def trained_with(cfg, ranks) -> dict:
    """The config's values by dotted path, and the sha256 of each local data file (`data.datasets.N.content`):
    a file edited in place, same record count or not, shows. A Hub dataset is known by its name, split and
    subset only."""
    settings = {k: v for k, v in flatten(cfg.dump()).items() if not _under(k, IGNORED)}
    for section in ("datasets", "val_datasets"):
        for i, spec in enumerate(getattr(cfg.data, section)):
            path = cfg.resolve_path(spec.path)
            if path.is_file():
                settings[f"data.{section}.{i}{CONTENT}"] = checkpoints.file_digest(path)
    settings[PROCESSES] = ranks.world
    return settings


def flatten(value, prefix: str = "") -> dict:
    """{"training.learning_rate": 0.001, "data.datasets.0.path": ...}: dicts and lists of dicts by path, other
    values (lists of names included) whole."""
    if isinstance(value, dict) and value:
        out = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}."))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {}
        for i, item in enumerate(value):
            out.update(flatten(item, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: value}


def _under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def kind_of(key: str, early_stopping: bool = False, same_global_batch: bool = False) -> str:
    """fixed, trains or neutral (the module docstring)."""
    if _under(key, FIXED) and not _under(key, UNFIXED):
        return "fixed"
    if key in BATCH:
        return "neutral" if same_global_batch else "trains"
    if early_stopping and _under(key, STOPPING):
        return "trains"
    return "neutral" if _under(key, NEUTRAL) else "trains"


def compare(old: dict, new: dict) -> list[dict]:
    """Each key whose value differs, with its kind. A key one side lacks is a change inside a list (a dataset
    added); outside lists it is a setting one mudpuppy version has and the other has not, and is skipped, as
    is a data digest one side did not record."""
    early_stopping = bool(old.get("training.early_stopping_patience") or new.get("training.early_stopping_patience"))
    same_batch = _global_batch(old) is not None and _global_batch(old) == _global_batch(new)
    changes = []
    for key in sorted(set(old) | set(new), key=_order):
        if key in old and key in new:
            if _same(old[key], new[key]):
                continue
        elif key.endswith(CONTENT) or not any(part.isdigit() for part in key.split(".")):
            continue
        change = {"key": key, "old": old.get(key), "new": new.get(key),
                  "kind": kind_of(key, early_stopping, same_batch)}
        if key.endswith(CONTENT):          # which file: a digest alone names none
            change["file"] = new.get(key.removesuffix(CONTENT) + ".path")
        changes.append(change)
    return changes


def _global_batch(settings: dict) -> int | None:
    values = [settings.get(key) for key in BATCH]
    return math.prod(values) if all(isinstance(v, int) for v in values) else None


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return float(a) == float(b)       # 1 and 1.0 from YAML are one value
    return a == b


def _order(key: str) -> list:
    """By name within a level, list items by number (data.datasets.10 after .9)."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]


# --------------------------------------------------------------------------- the check at --resume

def check_resume(cfg, record: dict, checkpoint: Path, echo) -> list[dict]:
    """The changes the run accepts by resuming `checkpoint` with `cfg` (its `record`, trained_with(cfg)), each
    with the step it takes effect at; an error naming every refused one. Before any model loads."""
    marker = _marker(checkpoint)
    old = marker.get(RECORD) if isinstance(marker, dict) else None
    if not isinstance(old, dict):
        old = _settings_from_config_copy(Path(cfg.output_dir), checkpoint, echo)
        if old is None:
            return []
    step = checkpoints.step_of(checkpoint)
    changes = compare(old, record)
    fixed = [c for c in changes if c["kind"] == "fixed"]
    trains = [c for c in changes if c["kind"] == "trains"]
    if fixed:
        raise MudpuppyError(
            f"cannot resume from {checkpoint}: its weights or optimizer state belong to settings this config "
            f"changes:\n{_lines(fixed)}\nno flag changes these; use the original values, or a new output_dir to "
            "start over")
    if trains and not changes_allowed():
        raise MudpuppyError(
            f"cannot resume from {checkpoint}: the config differs from what it was trained with:\n{_lines(trains)}\n"
            "use the original config; or pass --allow-changes to go on from step "
            f"{step} with the new values (each change is recorded in metrics.jsonl and run_summary.json); or choose "
            "a new output_dir to start over")
    if changes:
        echo(f"resuming at step {step} with changed settings, recorded in metrics.jsonl and run_summary.json:\n"
             + _lines(changes, notes={"trains": " (accepted: --allow-changes)",
                                      "neutral": " (does not change training)"}))
    return [{"step": step, "key": c["key"], "old": c["old"], "new": c["new"], "changes_training": c["kind"] == "trains"}
            for c in changes]


def history_of(checkpoint: Path) -> list[dict]:
    """The changes accepted before `checkpoint` was written (older checkpoints: none recorded)."""
    marker = _marker(checkpoint)
    found = marker.get(HISTORY) if isinstance(marker, dict) else None
    return list(found) if isinstance(found, list) else []


def _marker(checkpoint: Path):
    try:
        return json.loads((Path(checkpoint) / checkpoints.MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None       # checkpoints.checkpoint_problem names it; read_checkpoint refuses it


def _settings_from_config_copy(out: Path, checkpoint: Path, echo) -> dict | None:
    """A checkpoint written before checkpoints recorded their settings: the run's config.yaml is the best
    witness there is (its data files' content was not recorded)."""
    try:
        old = bounded_yaml_load((out / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, yaml.YAMLError):
        old = None
    if not isinstance(old, dict):
        echo(f"note: {checkpoint} does not record the settings it was trained with (written by an older "
             "mudpuppy) and the run has no readable config.yaml; resuming without comparing them")
        return None
    echo(f"note: {checkpoint} does not record the settings it was trained with (written by an older mudpuppy); "
         "comparing with the run's config.yaml (the data files' content cannot be compared)")
    return {k: v for k, v in flatten(old).items() if not _under(k, IGNORED)}


def _lines(changes: list[dict], notes: dict | None = None) -> str:
    return "\n".join(f"  {c['key']}: {_shown(c['old'])} -> {_shown(c['new'])}"
                     + (f" ({c['file']})" if c.get("file") else "") + (notes or {}).get(c["kind"], "")
                     for c in changes)


def _shown(value) -> str:
    if isinstance(value, str) and value.startswith("sha256:"):
        return value[:19]                 # sha256: and 12 hex digits: enough to tell two files apart
    return "(none)" if value is None else json.dumps(value) if isinstance(value, (list, dict, str)) else str(value)


# --------------------------------------------------------------------------- the run's record

class ChangesLine(Callback):
    """The metrics.jsonl line of the changes a resumed run accepted, at the step they took effect: written
    through the run's MetricsFile once it has opened the file (and cut it back to the resumed step), once
    however often the same step is resumed with the same changes."""

    def __init__(self, metrics: MetricsFile, changes: list[dict]):
        self.metrics, self.changes = metrics, changes

    def on_run_start(self, total: int, done: int) -> None:
        line = {"step": self.changes[0]["step"],
                HISTORY: [{k: c[k] for k in ("key", "old", "new", "changes_training")} for c in self.changes]}
        path = self.metrics.out / METRICS
        if path.is_file() and any(_parsed(text) == line for text in path.read_text(encoding="utf-8").splitlines()):
            return
        self.metrics.on_log(line)


def _parsed(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def changes_line(callbacks: list, changes: list[dict]) -> list:
    """ChangesLine for the run's MetricsFile among `callbacks` (none on a rank that writes no metrics)."""
    files = [c for c in callbacks if isinstance(c, MetricsFile)]
    return [ChangesLine(files[0], changes)] if changes and files else []
