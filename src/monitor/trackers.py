"""Experiment trackers: `logging.report_to: [tensorboard, mlflow, trackio, wandb]`, each offline by default.

metrics.jsonl stays the run's own record; a tracker receives the same
fields as each line is written (numbers only), the resolved config when the
run starts, and the summary at the end. Where each keeps its files unless
its own environment variable says otherwise:

    tensorboard   <output_dir>/tensorboard/            (TensorBoard event files)
    mlflow        MLFLOW_TRACKING_URI, else a file store in <output_dir>/mlruns
    trackio       trackio's own local SQLite store (TRACKIO_DIR, default ~/.cache/huggingface/trackio);
                  `trackio show --project mudpuppy` opens its dashboard
    wandb         WANDB_MODE, else offline, under <output_dir>/wandb/ (`wandb sync` uploads it later)

Each is an optional extra (`pip install 'mudpuppy[tensorboard]'`, ...). A tracker asked
for but not installed stops the run before any model loads (exit 2); a tracker
that fails mid-run is dropped with one warning, and the run goes on.

The trackers of a run are one callback of its training loop (callbacks.py):
each line of the run's record goes to them as metrics.jsonl gets it. They
stay open across the loops of one run (a method may run several) and close
with the summary (close_trackers, called by training/results.write_summary).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
import time
from pathlib import Path

from ..data.workers import scoped_env
from ..errors import MudpuppyError
from .callbacks import Callback

TRACKERS = ("tensorboard", "mlflow", "trackio", "wandb")
MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "trackio": "trackio", "wandb": "wandb"}
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "trackio": "trackio", "wandb": "wandb"}

# The open trackers of each run in this process, keyed by output directory: opened when the
# run's first loop starts, closed with the summary by results.write_summary.
_OPEN: dict[str, "Trackers"] = {}


def check_available(names: list[str]) -> None:
    """Before any model loads: every tracker asked for is importable."""
    missing = [n for n in names if importlib.util.find_spec(MODULES[n]) is None]
    if missing:
        extras = ",".join(EXTRAS[n] for n in missing)
        raise MudpuppyError(f"logging.report_to: {', '.join(missing)} is not installed; "
                          f"pip install 'mudpuppy[{extras}]' (or remove it from logging.report_to)")


def numeric(fields: dict) -> dict[str, float]:
    """The fields a tracker can plot: finite numbers (bools as 0/1)."""
    out = {}
    for key, value in fields.items():
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)) and math.isfinite(value) and key != "step":
            out[key] = float(value)
    return out


def flatten(data: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys (mlflow params, TensorBoard's text)."""
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = str(value)
    return out


class TensorBoard:
    """TensorBoard event files, written with the tensorboard package's own event writer and protos (those
    torch.utils.tensorboard's SummaryWriter writes through): each number a scalar (`simple_value`), the
    config a text summary. `tensorboard --logdir` reads them."""

    def __init__(self, out: Path, name: str, config: dict, project: str):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.writer = EventFileWriter(str(out / "tensorboard"))
        table = "\n".join(f"| {k} | {v} |" for k, v in flatten(config).items())
        self.add(text_summary("config", "| key | value |\n| --- | --- |\n" + table), 0)

    def add(self, summary, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self.writer.add_event(Event(summary=summary, wall_time=time.time(), step=int(step)))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.add(scalar_summary(key, value), step)
        self.writer.flush()

    def finish(self, summary: dict) -> None:
        for key, value in numeric(flatten_numbers(summary)).items():
            self.add(scalar_summary(f"summary/{key}", value), 0)
        self.writer.close()


def scalar_summary(tag: str, value: float):
    """One scalar as TensorBoard's scalars dashboard reads it."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])


def text_summary(tag: str, text: str):
    """A markdown text, as the text plugin reads it (under `<tag>/text_summary`, as SummaryWriter.add_text names it)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

    plugin = SummaryMetadata.PluginData(plugin_name="text", content=TextPluginData(version=0).SerializeToString())
    tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode("utf-8")],
                         tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
    return Summary(value=[Summary.Value(tag=tag + "/text_summary", metadata=SummaryMetadata(plugin_data=plugin),
                                        tensor=tensor)])


class MLflow:
    def __init__(self, out: Path, name: str, config: dict, project: str):
        import mlflow

        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (out / "mlruns").resolve().as_uri()
        # MLflow 3 keeps the file store but asks for an explicit opt-in to it; a local directory needs no
        # server and no database driver. It checks once, when the store is made (then cached per address),
        # so the opt-in holds only while the run starts, and a value the user set is theirs.
        asked = "MLFLOW_TRACKING_URI" in os.environ or "MLFLOW_ALLOW_FILE_STORE" in os.environ
        with contextlib.nullcontext() if asked else scoped_env("MLFLOW_ALLOW_FILE_STORE", "true"):
            mlflow.set_tracking_uri(uri)
            mlflow.set_experiment(project)
            self.run = mlflow.start_run(run_name=name)
        params = flatten(config)
        # MLflow caps a param value at 6000 characters and a batch at 100 params.
        items = [(k, v[:500]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            mlflow.log_params(dict(items[i:i + 100]))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=step)

    def finish(self, summary: dict) -> None:
        self.mlflow.log_metrics({f"summary/{k}": v for k, v in numeric(flatten_numbers(summary)).items()})
        self.mlflow.log_dict(summary, "run_summary.json")
        self.mlflow.end_run()


class Trackio:
    def __init__(self, out: Path, name: str, config: dict, project: str):
        import trackio      # its own local store: TRACKIO_DIR, read once when trackio is imported

        self.trackio = trackio
        trackio.init(project=project, name=name, config=config, resume="allow")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.trackio.log(values, step=step)

    def finish(self, summary: dict) -> None:
        self.trackio.finish()


class WandB:
    def __init__(self, out: Path, name: str, config: dict, project: str):
        import wandb

        # Offline unless the user's environment says otherwise (WANDB_MODE=online with a login).
        settings = wandb.Settings(mode=os.environ.get("WANDB_MODE", "offline"), silent=True)
        self.run = wandb.init(project=project, name=name, dir=str(out), config=config, settings=settings,
                              reinit="finish_previous")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def finish(self, summary: dict) -> None:
        self.run.summary.update(numeric(flatten_numbers(summary)))
        self.run.finish()


KINDS = {"tensorboard": TensorBoard, "mlflow": MLflow, "trackio": Trackio, "wandb": WandB}


def flatten_numbers(summary: dict) -> dict:
    """The summary's numbers, nested ones (eval_after.loss) as dotted names."""
    out = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


class Trackers(Callback):
    """The trackers of one run, a callback of its loops; each call goes to every tracker still working."""

    def __init__(self, active: dict):
        self.active = active

    def on_log(self, record: dict) -> None:
        self.log(record)

    def _each(self, what: str, *args) -> None:
        for name, tracker in list(self.active.items()):
            try:
                getattr(tracker, what)(*args)
            except Exception as exc:  # noqa: BLE001 - a tracker never stops a run
                print(f"warning: tracker {name} failed ({type(exc).__name__}: {exc}); it is dropped, "
                      "the run goes on (metrics.jsonl has everything)", file=sys.stderr)
                del self.active[name]

    def log(self, fields: dict) -> None:
        values = numeric(fields)
        if values and "step" in fields:
            self._each("log", int(fields["step"]), values)

    def finish(self, summary: dict) -> None:
        self._each("finish", summary)
        self.active = {}


def open_trackers(cfg, out: Path) -> Trackers | None:
    """Start the trackers a config asks for (rank 0 only), or None; kept open until close_trackers."""
    names = list(cfg.logging.report_to or [])
    if not names:
        return None
    key = str(Path(out).resolve())
    if key in _OPEN:                      # a second loop in the same run (e.g. a resumed stage)
        return _OPEN[key]
    project = cfg.logging.project or "mudpuppy"
    name = cfg.logging.run_name or Path(out).name
    config = cfg.dump()
    active = {}
    for kind in names:
        try:
            active[kind] = KINDS[kind](Path(out), name, config, project)
        except Exception as exc:  # noqa: BLE001 - the run goes on without it
            print(f"warning: tracker {kind} could not start ({type(exc).__name__}: {exc}); the run goes on "
                  "without it", file=sys.stderr)
    _OPEN[key] = Trackers(active)
    return _OPEN[key]


def close_trackers(out: Path, summary: dict) -> None:
    tracker = _OPEN.pop(str(Path(out).resolve()), None)
    if tracker is not None:
        tracker.finish(summary)
