"""`mudpuppy ui`'s server without a browser: the runs list read from the run folders' records, who may call
it (Host, Origin, Content-Type, token: serving/security.py's rules), no path outside the folder, the form
checked with the command line's own messages, and the live feed's delay."""

from __future__ import annotations

import http.client
import json
import os
import time

import pytest
import yaml
from click.testing import CliRunner

from mudpuppy.cli import main
from mudpuppy.errors import MudpuppyError
from mudpuppy.ui.server import UIServer

from .conftest import serving


def call(server, method: str, path: str, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    hdrs = {"Content-Type": "application/json"} if isinstance(body, dict) else {}
    conn.request(method, path, body=data, headers={**hdrs, **(headers or {})})
    res = conn.getresponse()
    raw = res.read()
    conn.close()
    try:
        return res.status, json.loads(raw), res
    except ValueError:
        return res.status, raw, res


def test_the_runs_list_reads_every_state_from_the_run_folders(ui):
    status, data, _ = call(ui, "GET", "/api/runs")
    assert status == 200
    rows = {r["name"]: r for r in data["runs"]}
    assert sorted(rows) == ["broken", "done", "group/halted"]
    done = rows["done"]
    assert (done["status"], done["method"], done["model"], done["adapter"], done["backend"]) == \
        ("finished", "sft", "tiny-llama", "lora", "cpu")
    assert done["steps"] == 4 and done["final_loss"] == 3.0
    assert done["heldout"] == {"loss": 2.5, "perplexity": 12.18}
    assert rows["group/halted"]["status"] == "stopped" and rows["group/halted"]["resumable"]
    assert rows["group/halted"]["steps"] == 2 and rows["group/halted"]["final_loss"] == 4.0
    assert rows["broken"]["status"] == "failed" and not rows["broken"]["resumable"]


def test_a_run_is_running_while_its_lock_names_a_live_process(ui, runs_root):
    lock = runs_root / "group" / "halted" / ".mudpuppy-run.lock"
    lock.write_text(json.dumps({"pid": os.getpid(), "command": "mudpuppy run x.yaml"}))
    rows = {r["name"]: r for r in call(ui, "GET", "/api/runs")[1]["runs"]}
    assert rows["group/halted"]["status"] == "running" and rows["group/halted"]["pid"] == os.getpid()
    lock.write_text(json.dumps({"pid": 2**22 + 12345, "command": "killed"}))     # a holder SIGKILLed long ago
    rows = {r["name"]: r for r in call(ui, "GET", "/api/runs")[1]["runs"]}
    assert rows["group/halted"]["status"] == "stopped"


@pytest.mark.parametrize("path", [
    "/api/file?path=../secret.txt", "/api/file?path=%2e%2e/secret.txt", "/api/file?path=/etc/passwd",
    "/api/file?path=done/../../secret.txt", "/api/file?path=link/secret.txt", "/api/run?name=..",
    "/api/run?name=../runs/done/../..", "/api/events?name=../", "/static/../server.py", "/static/..%2fserver.py",
    "/static/%2e%2e/jobs.py", "/../secret.txt"])
def test_no_path_outside_the_runs_folder_can_be_read(ui, runs_root, path):
    (runs_root / "link").symlink_to(runs_root.parent)          # a link inside that points out
    status, body, _ = call(ui, "GET", path)
    assert status in (403, 404), (path, status)
    assert b"not for the page" not in (body if isinstance(body, bytes) else json.dumps(body).encode())


def test_files_inside_the_folder_are_read(ui, runs_root):
    status, body, res = call(ui, "GET", "/api/file?path=done/config.yaml")
    assert status == 200 and b"tiny-llama" in body and res.getheader("Content-Type").startswith("text/plain")
    assert call(ui, "GET", "/api/file?path=done/.mudpuppy-run.lock")[0] == 404    # not a text or PNG file


@pytest.mark.parametrize("form", [{"output": "../escape"}, {"output": "/tmp/escape"}, {"output": "link/escape"},
                                  {"output": "."}, {"output": "ok", "source": "config", "config": "../secret.txt"}])
def test_no_path_outside_the_runs_folder_can_be_written(ui, runs_root, form):
    (runs_root / "link").symlink_to(runs_root.parent)
    before = sorted(os.listdir(runs_root.parent))
    for route in ("/api/validate", "/api/start"):
        status, body, _ = call(ui, "POST", route, {"model": "m", "data": "d.jsonl", **form})
        assert status == 400 or body["ok"] is False
    assert sorted(os.listdir(runs_root.parent)) == before
    assert not (runs_root / "ok").exists() and not (runs_root / ".mudpuppy-ui").exists()


def test_other_sites_and_hosts_are_refused_as_serve_refuses_them(ui):
    status, body, _ = call(ui, "GET", "/api/runs", headers={"Host": "evil.example:7860"})
    assert status == 403 and body["code"] == "invalid_host"            # DNS rebinding
    status, body, _ = call(ui, "POST", "/api/stop", {"run": "done"}, headers={"Origin": "http://evil.example"})
    assert status == 403 and body["code"] == "origin_not_allowed"
    status, body, _ = call(ui, "POST", "/api/stop", b'{"run": "done"}', headers={"Content-Type": "text/plain"})
    assert status == 415                                                  # a cross-site form's body
    port = ui.server_address[1]
    status, _, _ = call(ui, "GET", "/api/runs", headers={"Origin": f"http://127.0.0.1:{port}"})
    assert status == 200                                                  # the page's own origin


def test_beyond_loopback_the_page_needs_a_token(runs_root):
    with pytest.raises(MudpuppyError, match="--token"):
        UIServer(("0.0.0.0", 0), runs_root, None)


def test_a_port_in_use_is_one_message(ui, runs_root):
    with pytest.raises(MudpuppyError, match=f"--port {ui.server_address[1]}: cannot listen there"):
        UIServer(("127.0.0.1", ui.server_address[1]), runs_root, None)


def test_with_a_token_every_request_carries_it_and_the_page_gets_it_once_as_a_cookie(runs_root):
    with serving(runs_root, token="s3cret") as server:
        assert call(server, "GET", "/api/runs")[0] == 401
        assert call(server, "GET", "/")[0] == 401
        assert call(server, "GET", "/?token=wrong")[0] == 401
        assert call(server, "GET", "/api/runs", headers={"Authorization": "Bearer s3cret"})[0] == 200
        status, _, res = call(server, "GET", "/?token=s3cret")
        cookie = res.getheader("Set-Cookie")
        assert status == 303 and res.getheader("Location") == "/" and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert call(server, "GET", "/api/runs", headers={"Cookie": cookie.split(";")[0]})[0] == 200
        assert call(server, "GET", "/api/runs", headers={"Cookie": "mudpuppy_ui_token=nope"})[0] == 401


def test_the_form_is_checked_with_the_command_lines_own_messages(ui, runs_root, tiny_model_dir):
    data = runs_root.parent / "train.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    config = runs_root / "bad.yaml"
    config.write_text(yaml.safe_dump({"model": {"base_model": str(tiny_model_dir)}, "method": "sft",
                                      "data": {"datasets": [{"path": str(data)}]}, "output_dir": "x",
                                      "training": {"learning_rate": 0.001, "max_steps": 2}}))
    out = runs_root / "fresh"
    page = call(ui, "POST", "/api/validate", {"source": "config", "config": "bad.yaml", "output": "fresh",
                                              "backend": "cpu", "learning_rate": "-1"})[1]
    cli = CliRunner().invoke(main, ["validate", str(config), "--set", f"output_dir={out}", "--set", "backend=cpu",
                                    "--set", "training.learning_rate=-1.0"])
    assert cli.exit_code == 2 and not page["ok"]
    assert page["message"] == cli.stderr.strip()              # `error: ...: training.learning_rate: ...`
    assert "training.learning_rate" in page["message"]
    page = call(ui, "POST", "/api/validate", {"model": str(tiny_model_dir), "data": str(data), "method": "lora",
                                              "output": "fresh", "backend": "cpu", "max_steps": "0"})[1]
    cli = CliRunner().invoke(main, ["train", str(tiny_model_dir), str(data), "--method", "lora", "--output", str(out),
                                    "--backend", "cpu", "--max-steps", "0"])
    assert cli.exit_code == 2 and page["message"] == cli.stderr.strip() and "max_steps" in page["message"]
    page = call(ui, "POST", "/api/validate", {"source": "config", "config": "bad.yaml", "output": "fresh",
                                              "backend": "cpu"})[1]
    assert page["ok"] and page["message"].startswith("ok: mudpuppy run ")
    assert not out.exists()                                  # checking writes nothing


def read_events(server, path: str, until, timeout: float = 10.0):
    """The events of the live feed until `until(kind, data)` says so: [(kind, data, seconds after connect)]."""
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=timeout)
    conn.request("GET", path)
    res = conn.getresponse()
    assert res.status == 200 and res.getheader("Content-Type") == "text/event-stream"
    got, kind, start = [], None, time.monotonic()
    try:
        while time.monotonic() - start < timeout:
            line = res.fp.readline().decode().rstrip("\n")
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                got.append((kind, json.loads(line[6:]), time.monotonic()))
                if until(kind, got[-1][1]):
                    return got
    finally:
        conn.close()
    raise AssertionError(f"no such event within {timeout} s: {got}")


def test_a_new_metrics_line_reaches_the_page_within_two_seconds(ui, runs_root):
    metrics = runs_root / "group" / "halted" / "metrics.jsonl"
    size = metrics.stat().st_size
    written = {}

    def until(kind, data):
        if kind == "status" and "at" not in written:          # the feed is open: write the line now
            with metrics.open("a") as fh:
                fh.write(json.dumps({"step": 3, "loss": 3.25}) + "\n")
            written["at"] = time.monotonic()
        return kind == "metrics" and any(r.get("step") == 3 for r in data)

    got = read_events(ui, f"/api/events?name=group/halted&from={size}", until)
    delay = got[-1][2] - written["at"]
    assert got[-1][1] == [{"step": 3, "loss": 3.25}]
    assert delay < 2.0, f"{delay:.2f} s from the line to the page"


def test_log_lines_written_between_the_page_and_its_feed_are_not_lost(ui, runs_root):
    """The page reads the log's tail (/api/run), then opens the feed from where that copy ends (log_from):
    a line printed in between ("resumed from ...", as a resume prints it early) still reaches the page."""
    log = ui.jobs.log_path("group/halted")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("$ mudpuppy run ...\n")
    status, page, _ = call(ui, "GET", "/api/run?name=group/halted")
    assert status == 200 and page["log"] == "$ mudpuppy run ...\n" and page["log_size"] == log.stat().st_size
    with log.open("a") as fh:
        fh.write("resumed from checkpoints/step-00000002 (step 2 of 4)\n")
    got = read_events(ui, f"/api/events?name=group/halted&from=0&log_from={page['log_size']}",
                      lambda kind, data: kind == "log")
    assert [data for kind, data, _ in got if kind == "log"] == ["resumed from checkpoints/step-00000002 (step 2 of 4)\n"]


def test_a_metrics_file_cut_back_by_a_resume_resets_the_curves(ui, runs_root):
    metrics = runs_root / "done" / "metrics.jsonl"

    def until(kind, data):
        if kind == "metrics" and len(data) == 5:             # everything, then the file is cut back
            metrics.write_text(json.dumps({"step": 1, "loss": 4.5}) + "\n")
        return kind == "metrics" and data == [{"step": 1, "loss": 4.5}]

    kinds = [kind for kind, _, _ in read_events(ui, "/api/events?name=done&from=0", until)]
    assert kinds.index("reset") < len(kinds) - 1


def test_the_page_and_its_assets_are_served(ui):
    status, body, res = call(ui, "GET", "/")
    assert status == 200 and b"/static/app.js" in body and res.getheader("X-Frame-Options") == "DENY"
    for name in ("app.js", "charts.js", "style.css"):
        assert call(ui, "GET", f"/static/{name}")[0] == 200


def test_the_verb_serves_the_folder_and_ctrl_c_ends_it(runs_root):
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "mudpuppy.cli", "ui", str(runs_root), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"mudpuppy ui: {runs_root} at http://127.0.0.1:"), line
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/api/runs")
        names = sorted(r["name"] for r in json.loads(conn.getresponse().read())["runs"])
        assert names == ["broken", "done", "group/halted"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
