"""A run started from the page is `mudpuppy run` itself: on the same config it logs the same losses as the
command line, its folder gets the same records, and the page's own files stay in RUNS_DIR/.mudpuppy-ui."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import yaml

from ..conftest import tiny_run_config
from .conftest import serving
from .test_server import call


def losses(folder):
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def test_a_run_from_the_page_logs_the_losses_of_mudpuppy_run_on_the_same_config(tmp_path, tiny_model_dir):
    root = tmp_path / "runs"
    root.mkdir()
    cfg = tiny_run_config(tiny_model_dir, tmp_path / "unused")
    cfg["training"]["max_steps"] = 3
    cfg["eval"] = {"exact_match": False}
    (root / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    with serving(root) as server:
        status, body, _ = call(server, "POST", "/api/start", {"source": "config", "config": "tiny.yaml",
                                                               "output": "from-page", "backend": "cpu"})
        assert status == 200, body
        assert body["job"]["args"][:2] == ["run", str(root / "tiny.yaml")]
        end = time.monotonic() + 300
        while time.monotonic() < end:
            rows = {r["name"]: r for r in call(server, "GET", "/api/runs")[1]["runs"]}
            if rows.get("from-page", {}).get("status") in ("finished", "failed"):
                break
            time.sleep(0.5)
        assert rows["from-page"]["status"] == "finished", (root / ".mudpuppy-ui" / "logs" / "from-page.log").read_text()
        assert rows["from-page"]["steps"] == 3 and rows["from-page"]["device"] == "cpu"
        record = root / ".mudpuppy-ui" / "jobs" / "from-page.json"
        while json.loads(record.read_text())["exit_code"] is None and time.monotonic() < end:
            time.sleep(0.2)                # the summary is written just before the process ends
        assert json.loads(record.read_text())["exit_code"] == 0
        # the same folder again: refused before anything starts, as `mudpuppy run` would refuse it
        status, body, _ = call(server, "POST", "/api/start", {"source": "config", "config": "tiny.yaml",
                                                               "output": "from-page", "backend": "cpu"})
        assert status == 400 and "already holds files" in body["error"]
    done = subprocess.run([sys.executable, "-m", "mudpuppy.cli", "run", str(root / "tiny.yaml"), "--set",
                           f"output_dir={tmp_path / 'from-cli'}", "--set", "backend=cpu"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    page, cli = losses(root / "from-page"), losses(tmp_path / "from-cli")
    assert len(page) == 3 and page == cli
    assert sorted(p.name for p in root.iterdir()) == [".mudpuppy-ui", "from-page", "tiny.yaml"]
