"""The run directory mudpuppy owns (issue 25): --overwrite removes only what a marked run wrote, and only
once the new run has loaded its model and data; it refuses directories whose loss no marker excuses; a
lock keeps a second process out of a directory a run is using, and a killed run leaves no lock behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mudpuppy import create_backend, load_config, run
from mudpuppy.errors import OutputExists
from mudpuppy.output_dir import claim, locks, rundir

# A `mudpuppy run` that, once it has logged step GATE_STEP, waits until the file named by its first argument
# exists: a run caught in the middle of training, as long as a test needs it.
GATED = """
import os, sys, time
from pathlib import Path
from mudpuppy.monitor.metrics import MetricsLog
gate, at = Path(sys.argv.pop(1)), int(os.environ.get("GATE_STEP", "1"))
write = MetricsLog.write
def gated(self, **fields):
    write(self, **fields)
    while fields.get("step") == at and "loss" in fields and not gate.exists():
        time.sleep(0.05)
MetricsLog.write = gated
from mudpuppy.cli import main
sys.argv[0] = "mudpuppy"
main()
"""


def cli(cfg_path, *extra, env=None):
    return subprocess.run([sys.executable, "-m", "mudpuppy.cli", "run", "-c", str(cfg_path), *extra],
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300)


def gated_cli(tmp_path, cfg_path, gate, *extra, step=1):
    script = tmp_path / "gated.py"
    script.write_text(GATED)
    return subprocess.Popen([sys.executable, str(script), str(gate), "run", "-c", str(cfg_path), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "GATE_STEP": str(step)})


def wait_for_step(out: Path, step: int, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        if (out / "metrics.jsonl").is_file() and any(
                json.loads(line).get("step") == step for line in (out / "metrics.jsonl").read_text().splitlines()
                if line.strip()):
            return
        time.sleep(0.1)
    raise AssertionError(f"step {step} never logged")


def write_config(tmp_path, cfg, name="cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def quick(tiny_config, out, **training):
    cfg = dict(tiny_config, output_dir=str(out))
    cfg["training"] = dict(tiny_config["training"], max_steps=3, **training)
    cfg["eval"] = {"before_training": False, "after_training": False}
    return cfg


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error")]


def snapshot(out: Path) -> dict:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != rundir.LOCK}


# --------------------------------------------------------------------------- refusals (no model needed)
def make_project(folder: Path) -> dict:
    """A user's project folder that happens to have names a run also writes."""
    (folder / "src").mkdir(parents=True)
    (folder / ".git").mkdir()
    (folder / "src" / "main.py").write_text("print('mine')\n")
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / "notes.md").write_text("my notes\n")
    (folder / "config.yaml").write_text("mine: true\n")
    return snapshot(folder)


@pytest.mark.parametrize("extra", [[], ["metrics.jsonl"]])
def test_overwrite_refuses_a_project_folder(tmp_path, extra):
    project = tmp_path / "project"
    make_project(project)
    for name in extra:           # with a metrics.jsonl it looks like a run from before markers: still refused
        (project / name).write_text("{}\n")
    before = snapshot(project)
    with pytest.raises(OutputExists, match="rm -r" if extra else "does not look like a mudpuppy run") as err:
        claim.claim_dir(project, overwrite=True)
    assert snapshot(project) == before and not (project / rundir.MARKER).exists()
    assert not (project / rundir.LOCK).exists()
    assert "\n" not in str(err.value)


def test_overwrite_refuses_cwd_home_root_and_their_ancestors(tmp_path, monkeypatch):
    work = tmp_path / "home" / "me" / "work"
    work.mkdir(parents=True)
    (work / rundir.MARKER).write_text("{}")        # even a marked directory
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home" / "me"))
    for target, why in [(".", "the current directory"), (str(work), "the current directory"),
                        ("..", "a directory above the current one"), ("~", "a directory above the current one"),
                        ("/", "the filesystem root")]:
        with pytest.raises(OutputExists, match=why):
            claim.claim_dir(target, overwrite=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputExists, match="the home directory"):
        claim.claim_dir("~", overwrite=True)
    with pytest.raises(OutputExists, match="a directory above the home directory"):
        claim.claim_dir(tmp_path / "home", overwrite=True)


def test_output_dir_expands_the_home_directory(tiny_config, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_config(dict(tiny_config, output_dir="~/runs/a")).output_dir == str(tmp_path / "runs" / "a")


def test_overwrite_refuses_the_directory_holding_the_config_or_data(tiny_config, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / rundir.MARKER).write_text(json.dumps({"format": 1, "written": ["config.yaml"], "foreign": []}))
    data = out / "train.jsonl"
    data.write_text(Path(tiny_config["data"]["datasets"][0]["path"]).read_text())
    cfg = dict(tiny_config, output_dir=str(out))
    cfg["data"] = dict(tiny_config["data"], datasets=[{"path": str(data)}])
    with pytest.raises(OutputExists, match="data.datasets.0.path"):
        claim.claim_dir(out, True, cfg=load_config(cfg))
    # The config file's folder: `output_dir: .` beside the config, resolved from elsewhere.
    cfg_path = write_config(out, dict(tiny_config, output_dir=str(out)))
    with pytest.raises(OutputExists, match="the config file's folder"):
        claim.claim_dir(out, True, cfg=load_config(cfg_path))
    assert data.is_file() and cfg_path.is_file()


def test_a_new_run_never_writes_into_a_foreign_folder(tmp_path):
    project = tmp_path / "project"
    before = make_project(project)
    with pytest.raises(OutputExists, match="does not look like a mudpuppy run"):
        claim.claim_dir(project, overwrite=False)
    assert snapshot(project) == before and not (project / rundir.LOCK).exists()


# --------------------------------------------------------------------------- replacing a marked run
def test_overwrite_replaces_only_what_the_run_wrote(tiny_config, tmp_path):
    out = tmp_path / "run"
    cfg = quick(tiny_config, out, save_steps=2)
    run(load_config(cfg), create_backend("cpu"), echo=lambda *_: None)
    marker = rundir.read_marker(out)
    assert {"config.yaml", "metrics.jsonl", "run_summary.json", "checkpoints", "adapter_model.safetensors"} \
        <= set(marker["written"]) and marker["foreign"] == []
    (out / "notes.md").write_text("what I learned\n")          # the user's, added after the run
    (out / "gguf").mkdir()
    (out / "gguf" / "model.gguf").write_bytes(b"GGUF")

    said = []
    cfg["training"]["save_steps"] = None
    run(load_config(cfg), create_backend("cpu"), overwrite=True, echo=said.append)
    assert (out / "notes.md").read_text() == "what I learned\n" and (out / "gguf" / "model.gguf").is_file()
    assert not (out / "checkpoints").exists()                 # the old run's, gone with it
    assert (out / "run_summary.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert any("kept 2 entries the previous run did not write: gguf, notes.md" in line for line in said)
    assert rundir.read_marker(out)["foreign"] == ["gguf", "notes.md"]
    assert free_for_another_process(out)                       # released with the summary


def test_a_run_from_before_markers_is_resumed_and_adopted(tiny_config, tmp_path):
    out = tmp_path / "run"
    cfg = quick(tiny_config, out, save_steps=2)
    cfg["training"]["max_steps"] = 4
    run(load_config(cfg), create_backend("cpu"), echo=lambda *_: None)
    (out / rundir.MARKER).unlink()
    (out / "run_summary.json").unlink()                        # an unfinished run of an older mudpuppy
    cfg["resume"] = True
    result = run(load_config(cfg), create_backend("cpu"), echo=lambda *_: None)
    assert result.resumed_from == 4 and rundir.read_marker(out) is not None


# --------------------------------------------------------------------------- the real command line
def test_a_typo_in_the_model_after_overwrite_loses_nothing(tiny_config, tmp_path):
    out = tmp_path / "run"
    cfg_path = write_config(tmp_path, quick(tiny_config, out))
    assert cli(cfg_path).returncode == 0
    before = snapshot(out)
    failed = cli(cfg_path, "--overwrite", "--set", f"model.base_model={tmp_path / 'tiny-lama'}")
    assert failed.returncode == 2
    assert len(error_lines(failed.stderr)) == 1 and "tiny-lama" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert snapshot(out) == before


def test_overwrite_refuses_dot_on_the_command_line(tiny_config, tmp_path):
    folder = tmp_path / "project"
    before = make_project(folder)
    cfg_path = write_config(folder, quick(tiny_config, "."), name="run.yaml")
    before["run.yaml"] = cfg_path.read_bytes()
    done = subprocess.run([sys.executable, "-m", "mudpuppy.cli", "run", "run.yaml", "--overwrite"], cwd=folder,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and len(error_lines(done.stderr)) == 1
    assert "the current directory" in done.stderr
    assert snapshot(folder) == before


def test_a_second_process_is_refused_while_a_run_trains(tiny_config, tmp_path):
    out = tmp_path / "run"
    cfg_path = write_config(tmp_path, quick(tiny_config, out, save_steps=1))
    gate = tmp_path / "gate"
    first = gated_cli(tmp_path, cfg_path, gate, step=2)
    try:
        wait_for_step(out, 2, first)
        for flag in ("--resume", "--overwrite"):
            second = cli(cfg_path, flag)
            assert second.returncode == 2, second.stderr
            assert len(error_lines(second.stderr)) == 1
            assert f"in use by another mudpuppy process (pid {first.pid}" in second.stderr
            assert "mudpuppy run -c" in second.stderr              # the holder's command
        assert (out / "checkpoints").is_dir() and not (out / "run_summary.json").exists()
    finally:
        gate.touch()
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(l)] == [1, 2, 3]
    assert (out / rundir.LOCK).read_text() == ""               # released, no pid left behind
    again = cli(cfg_path, "--overwrite")                       # both end well
    assert again.returncode == 0, again.stderr


def test_a_killed_run_leaves_no_lock(tiny_config, tmp_path):
    out = tmp_path / "run"
    cfg_path = write_config(tmp_path, quick(tiny_config, out, save_steps=1))
    gate = tmp_path / "gate"
    first = gated_cli(tmp_path, cfg_path, gate, step=2)
    wait_for_step(out, 2, first)
    assert str(first.pid) in (out / rundir.LOCK).read_text()
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL
    resumed = cli(cfg_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    assert "checkpoints" in rundir.read_marker(out)["written"]


# --------------------------------------------------------------------------- curricula
def test_curriculum_overwrite_replaces_each_stage_when_it_starts(tiny_model_dir, tmp_path):
    from mudpuppy import load_curriculum, run_curriculum
    from mudpuppy.errors import MudpuppyError

    from .test_curriculum import curriculum

    raw = curriculum(tiny_model_dir, tmp_path / "c")
    raw["stages"] = raw["stages"][:2]
    cur = load_curriculum(raw)
    assert run_curriculum(cur, echo=lambda *_: None).ran == ["stage-1-intents", "stage-2-more-intents"]
    (cur.stages[0].dir / "notes.md").write_text("mine")
    old_second = snapshot(cur.stages[1].dir)

    def broken_second_stage(cfg):
        if "more-intents" in cfg.output_dir:
            raise MudpuppyError("no such backend today")
        return create_backend(cfg.backend)

    with pytest.raises(MudpuppyError, match="no such backend"):
        run_curriculum(cur, overwrite=True, echo=lambda *_: None, backend_for=broken_second_stage)
    assert (cur.stages[0].dir / "notes.md").read_text() == "mine"          # kept by stage 1's replacement
    assert snapshot(cur.stages[1].dir) == old_second                         # not started: untouched
    # Run again without --overwrite: stage 1 (new) is done, stage 2's old run is replaced, not skipped.
    again = run_curriculum(cur, echo=lambda *_: None)
    assert again.ran == ["stage-2-more-intents"]
    assert rundir.read_marker(cur.stages[1].dir)["created_at"] > json.loads(
        (cur.output_dir / "curriculum.json").read_text())["replaced_before"]
    assert free_for_another_process(cur.output_dir) and free_for_another_process(cur.stages[1].dir)


def free_for_another_process(out: Path) -> bool:
    """Whether `out`'s lock can be taken now through a new open file, as another process would take it
    (flock conflicts between open files of one process too, so a hold this process kept shows)."""
    try:
        fd = locks.acquire_lock(out / rundir.LOCK, f"output_dir {out}", "output_dir", rundir.RunDirInUse)
    except rundir.RunDirInUse:
        return False
    locks.release_lock(fd)
    return True
