"""Export and evaluation from the page: `mudpuppy export` / `mudpuppy eval` as child processes with the command
line a terminal would type; a second export into the same folder refused with the CLI's own message unless
overwrite is ticked; eval's table rebuilt from its eval.json as it printed it; the run page's extras."""

from __future__ import annotations

import json
import os
import time

from click.testing import CliRunner

from mudpuppy.cli import main

from .conftest import serving
from .test_server import call


def finish(ui, task: dict, timeout: float = 300) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        status, found, _ = call(ui, "GET", f"/api/task?id={task['id']}")
        assert status == 200, found
        if found["exit_code"] is not None:
            return found
        time.sleep(0.3)
    raise AssertionError(f"task {task['id']} still running after {timeout} s")


def test_an_export_runs_the_cli_and_a_second_one_needs_overwrite(finished_runs):
    run = finished_runs / "a"
    form = {"run": "a", "format": "gguf", "quant": "f16", "evaluate": False}
    with serving(finished_runs) as ui:
        status, body, _ = call(ui, "POST", "/api/export", form)
        assert status == 200, body
        assert body["task"]["args"] == ["export", str(run), "--format", "gguf", "--quant", "f16", "--no-eval"]
        done = finish(ui, body["task"])
        assert done["exit_code"] == 0, done["log"]
        assert done["path"] == str(run / "export" / "gguf-f16") and done["exists"]
        assert any(f.endswith(".gguf") for f in done["files"])

        again = finish(ui, call(ui, "POST", "/api/export", form)[1]["task"])
        cli = CliRunner().invoke(main, ["export", str(run), "--format", "gguf", "--quant", "f16", "--no-eval"])
        assert again["exit_code"] == cli.exit_code != 0
        assert again["error"] in cli.output and "pass --overwrite" in again["error"]

        replaced = finish(ui, call(ui, "POST", "/api/export", {**form, "overwrite": True})[1]["task"])
        assert replaced["args"][-1] == "--overwrite" and replaced["exit_code"] == 0 and replaced["exists"]
        status, page, _ = call(ui, "GET", "/api/run?name=a")
        assert [t["id"] for t in page["exports"]][:3] == [replaced["id"], again["id"], done["id"]]

        status, bad, _ = call(ui, "POST", "/api/export", {**form, "quant": "q9"})
        assert status == 400 and bad["error"].startswith("error: --quant q9")
        status, bad, _ = call(ui, "POST", "/api/export", {**form, "run": "../a"})
        assert status == 400 and "outside the runs folder" in bad["error"]


def test_one_click_evaluates_the_ticked_runs_side_by_side(finished_runs):
    with serving(finished_runs) as ui:
        choices = call(ui, "GET", "/api/choices")[1]
        assert choices["data"] == ["data/val.jsonl"] and "q4_k_m" in choices["quants"]["gguf"]
        status, body, _ = call(ui, "POST", "/api/eval", {"runs": ["a", "b"], "data": "data/val.jsonl", "max_samples": 4})
        assert status == 200, body
        task = body["task"]
        out = finished_runs / ".mudpuppy-ui" / "evals" / task["id"]
        assert task["args"] == ["eval", str(finished_runs / "a"), str(finished_runs / "b"), "--data",
                                str(finished_runs / "data" / "val.jsonl"), "--out", str(out), "--max-samples", "4"]
        done = finish(ui, task)
        assert done["exit_code"] == 0, done["log"]
        table = done["table"]
        assert table["header"] == ["", "a", "b"] and len(table["rows"]) >= 2
        printed = done["log"].splitlines()
        for row in table["rows"]:                     # each row as `mudpuppy eval` printed it
            assert any(line.split() == " ".join(row).split() for line in printed), row
        assert json.loads((out / "eval.json").read_text())["data"]["path"].endswith("val.jsonl")

        status, bad, _ = call(ui, "POST", "/api/eval", {"runs": ["a"], "data": "../secret.jsonl"})
        assert status == 400 and "outside the runs folder" in bad["error"]
        status, bad, _ = call(ui, "POST", "/api/eval", {"runs": [], "data": "data/val.jsonl"})
        assert status == 400 and bad["error"] == "error: runs: tick the runs to evaluate"


def test_the_run_page_shows_the_training_process_readings_and_sampled_completions(runs_root):
    folder = runs_root / "group" / "halted"
    rows = [{"step": s, "prompt": [{"role": "user", "content": f"q{s}"}], "completion": f"answer {s}",
             "rewards": {"exact": float(s % 2)}, "advantage": 0.5} for s in range(1, 11)]
    (folder / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / ".mudpuppy-run.lock").write_text(json.dumps({"pid": os.getpid()}))
    with serving(runs_root) as ui:
        page = call(ui, "GET", "/api/run?name=group/halted")[1]
    live = {r["name"]: r for r in page["hardware"]["live"]}
    assert live["process RSS"]["used"] > 0 and live["process RSS"]["source"] == "psutil"
    assert 0 <= live["CPU busy"]["percent"]
    assert [s["completion"] for s in page["samples"]] == [f"answer {s}" for s in range(3, 11)]
    assert page["samples"][-1] == {"step": 10, "prompt": "q10", "completion": "answer 10", "rewards": {"exact": 0.0},
                                   "advantage": 0.5}


def test_the_run_page_shows_the_device_memory_peaks_the_run_recorded(runs_root):
    summary = json.loads((runs_root / "done" / "run_summary.json").read_text())
    summary["memory"] = {"load": {"allocated": 2**30, "reserved": 2**31}, "training": {"allocated": 3 * 2**30}}
    (runs_root / "done" / "run_summary.json").write_text(json.dumps(summary))
    with serving(runs_root) as ui:
        page = call(ui, "GET", "/api/run?name=done")[1]
    assert page["hardware"] == {"live": [], "peaks": [{"phase": "load", "allocated": 2**30, "reserved": 2**31},
                                                      {"phase": "training", "allocated": 3 * 2**30}]}
