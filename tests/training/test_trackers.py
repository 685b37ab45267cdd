"""logging.report_to: each tracker's files, read back with that tracker's own reader, hold the run's metrics."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from mudpuppy.cli import main
from mudpuppy.errors import MudpuppyError
from mudpuppy.monitor import trackers


def metrics(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def run_cli(cfg: dict, tmp_path: Path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return CliRunner().invoke(main, ["run", "-c", str(path)])


def read_wandb_records(path: Path):
    """W&B's transaction log (LevelDB log format: 32 KiB blocks of crc32c, length, type, data after a 7-byte
    ':W&B' header), each record a wandb_internal_pb2.Record, as wandb-core writes it."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:                     # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += room
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):               # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.mark.parametrize("kind", ["tensorboard", "mlflow", "wandb", "trackio"])
def test_tracker_files_hold_the_logged_metrics(kind, tiny_config, tmp_path):
    pytest.importorskip({"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb",
                         "trackio": "trackio"}[kind])
    tiny_config["training"]["max_steps"] = 3
    tiny_config["eval"] = {"exact_match": False}
    tiny_config["logging"] = {"progress_bar": False, "report_to": [kind], "project": f"mp-{kind}",
                              "run_name": "tiny"}
    # A real process, as a user runs it (wandb's service does not write its history under click's
    # CliRunner, whose stdout is not a file).
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_config))
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "WANDB_MODE")}
    env["TRACKIO_DIR"] = str(tmp_path / "trackio")
    res = subprocess.run([sys.executable, "-m", "mudpuppy", "run", "-c", str(path)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = Path(tiny_config["output_dir"])
    expected = metrics(out)
    assert sorted(expected) == [1, 2, 3]

    if kind == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(out / "tensorboard"))
        acc.Reload()
        got = {e.step: e.value for e in acc.Scalars("loss")}
        assert "grad_norm" in acc.Tags()["scalars"] and "summary/final_loss" in acc.Tags()["scalars"]
    elif kind == "mlflow":
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")     # MLflow 3 asks for it to read a file store
        from mlflow.tracking import MlflowClient

        client = MlflowClient((out / "mlruns").resolve().as_uri())
        (run,) = client.search_runs([client.get_experiment_by_name("mp-mlflow").experiment_id])
        assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
        assert run.data.params["training.max_steps"] == "3"
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    elif kind == "wandb":
        (log,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
        got, config = {}, None
        for record in read_wandb_records(log):
            which = record.WhichOneof("record_type")
            if which == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                if "loss" in items:
                    got[items["_step"]] = items["loss"]
            elif which == "run":
                config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
        assert config["training"]["max_steps"] == 3
    else:
        # trackio reads TRACKIO_DIR once, at import: read its store in a process of its own too.
        code = ("import json; from trackio.sqlite_storage import SQLiteStorage; "
                "print(json.dumps(SQLiteStorage.get_logs('mp-trackio', 'tiny')))")
        read = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert read.returncode == 0, read.stderr[-2000:]
        logs = json.loads(read.stdout.strip().splitlines()[-1])
        got = {row["step"]: row["loss"] for row in logs if "loss" in row}
    assert got == pytest.approx(expected, rel=1e-6)


def test_a_tracker_that_is_not_installed_stops_the_run_before_it_starts(tiny_config, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    tiny_config["logging"] = {"progress_bar": False, "report_to": ["tensorboard", "wandb"]}
    res = run_cli(tiny_config, tmp_path)
    assert res.exit_code == 2
    assert "logging.report_to: wandb is not installed; pip install 'mudpuppy[wandb]'" in res.output
    assert not Path(tiny_config["output_dir"]).exists()
    with pytest.raises(MudpuppyError):
        trackers.check_available(["wandb"])


def test_a_tracker_failing_mid_run_is_dropped_and_the_run_goes_on(capsys):
    class Broken:
        def log(self, step, values):
            raise RuntimeError("disk full")

    class Kept:
        seen = []

        def log(self, step, values):
            self.seen.append((step, values))

        def finish(self, summary):
            self.seen.append(("finish", summary))

    t = trackers.Trackers({"broken": Broken(), "kept": Kept()})
    t.log({"step": 1, "loss": 0.5, "skipped": False, "note": "x", "nan": float("nan")})
    t.log({"step": 2, "loss": 0.25})
    t.finish({"final_loss": 0.25})
    assert Kept.seen == [(1, {"loss": 0.5, "skipped": 0.0}), (2, {"loss": 0.25}), ("finish", {"final_loss": 0.25})]
    assert "tracker broken failed (RuntimeError: disk full)" in capsys.readouterr().err
