"""The output contract (src/output_dir/) for `merge` and the run directory, through the real command line
on the tiny model (issue 37, "Files lost"): merge never clears a folder that is not its own, a failed or
killed merge leaves the earlier merged model whole, a user's file survives --overwrite, and a run claims
only what it wrote itself (never a file the user or another verb put in its directory)."""

from __future__ import annotations

import json
import shutil

import yaml

from mudpuppy.output_dir import rundir

from ..contract_helpers import Held, cli, hidden, one_error, snapshot

SAVE_TOKENIZER = "mudpuppy.backends.torch.backend:save_tokenizer"     # merge_and_save: weights, then this


def write_cfg(tmp_path, tiny_config, name="cfg.yaml", **changes):
    cfg = dict(tiny_config, **changes)
    cfg["training"] = dict(tiny_config["training"], max_steps=2)
    cfg["eval"] = {"before_training": False, "after_training": False}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def trained(tmp_path, tiny_config, **changes):
    cfg_path = write_cfg(tmp_path, tiny_config, **changes)
    done = cli("run", "-c", cfg_path)
    assert done.returncode == 0, done.stderr
    return cfg_path, tmp_path / "run"


def merged(cfg_path, *extra):
    return cli("merge", "-c", cfg_path, "--dtype", "float32", *extra)


# --------------------------------------------------------------------------- merge
def test_merge_overwrite_never_clears_a_folder_that_is_not_a_merge(tiny_config, tiny_model_dir, tmp_path):
    cfg_path, _ = trained(tmp_path, tiny_config)
    copy = tmp_path / "my-base"                       # a copy of the base model, with the user's notes
    shutil.copytree(tiny_model_dir, copy)
    (copy / "notes.md").write_text("where this model came from\n")
    before = snapshot(copy)
    one_error(merged(cfg_path, "--out", copy, "--overwrite"), "does not look like", "refusing")
    # the same folder reached through a typo in model.base_model: still refused, before anything loads
    one_error(merged(cfg_path, "--out", copy, "--overwrite", "--set", f"model.base_model={tmp_path / 'no-such'}"),
              "refusing")
    assert snapshot(copy) == before and hidden(tmp_path) == []


def test_a_failed_merge_overwrite_keeps_the_previous_merge_and_the_users_files(tiny_config, tmp_path):
    cfg_path, run = trained(tmp_path, tiny_config)
    assert merged(cfg_path).returncode == 0
    (run / "merged" / "notes.md").write_text("mine\n")
    before = snapshot(run / "merged")
    failed = merged(cfg_path, "--overwrite", "--set", f"model.base_model={tmp_path / 'tiny-lama'}")
    one_error(failed, "tiny-lama")
    assert snapshot(run / "merged") == before
    again = merged(cfg_path, "--overwrite")
    assert again.returncode == 0, again.stderr
    assert (run / "merged" / "notes.md").read_text() == "mine\n"          # the user's file survives
    record = json.loads((run / "merged" / "export.json").read_text())
    assert "notes.md" not in record["files"] and "model.safetensors" in record["files"]
    assert [p.name for p in run.iterdir() if p.name.startswith(".merged")] == []


def test_a_killed_merge_leaves_no_half_model_and_the_next_merge_cleans_up(tiny_config, tmp_path):
    cfg_path, run = trained(tmp_path, tiny_config)
    assert merged(cfg_path).returncode == 0
    before = snapshot(run / "merged")
    held = Held(tmp_path / "held", SAVE_TOKENIZER, "before", "merge", "-c", cfg_path, "--overwrite")
    held.wait()                                       # weights written, the tokenizer not yet
    staging = [p for p in run.iterdir() if p.name.startswith(".merged.mudpuppy-")]
    assert any((p / "model.safetensors").is_file() for p in staging)
    held.kill()
    assert snapshot(run / "merged") == before         # the final name still holds the whole earlier model
    chat = cli("chat", run / "merged", "--max-new-tokens", "2", stdin="hi\n")
    assert chat.returncode == 0, chat.stderr
    again = merged(cfg_path, "--overwrite")
    assert again.returncode == 0, again.stderr
    assert f"pid {held.pid}" in again.stdout          # the killed merge's staging folder, removed
    assert [p.name for p in run.iterdir() if p.name.startswith(".merged")] == []


def test_chat_on_a_half_written_model_is_one_message(tiny_config, tmp_path):
    cfg_path, run = trained(tmp_path, tiny_config)
    assert merged(cfg_path).returncode == 0
    half = tmp_path / "half"                          # what a merge killed before its tokenizer used to leave
    shutil.copytree(run / "merged", half)
    for path in half.glob("tokenizer*"):
        path.unlink()
    one_error(cli("chat", half, stdin="hi\n"), "no tokenizer", "incomplete")


# --------------------------------------------------------------------------- the run directory
def test_a_resumed_run_from_before_markers_claims_only_its_own_names(tiny_config, tmp_path):
    cfg = dict(tiny_config)
    cfg["training"] = dict(tiny_config["training"], max_steps=2, save_steps=1)
    cfg["eval"] = {"before_training": False, "after_training": False}
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    assert cli("run", "-c", cfg_path).returncode == 0
    (run / rundir.MARKER).unlink()                    # an unfinished run of an older mudpuppy
    (run / "run_summary.json").unlink()
    (run / "notes.md").write_text("my notes\n")
    (run / "my-analysis").mkdir()
    (run / "my-analysis" / "plot.py").write_text("print(1)\n")
    resumed = cli("run", "-c", cfg_path, "--resume")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr
    marker = rundir.read_marker(run)
    assert {"notes.md", "my-analysis"} <= set(marker["foreign"])
    assert not {"notes.md", "my-analysis"} & set(marker["written"])
    assert {"config.yaml", "checkpoints", "adapter_model.safetensors"} <= set(marker["written"])
    again = cli("run", "-c", cfg_path, "--overwrite")
    assert again.returncode == 0, again.stderr
    assert (run / "notes.md").read_text() == "my notes\n" and (run / "my-analysis" / "plot.py").is_file()


def test_what_others_write_in_a_live_run_is_not_claimed(tiny_config, tiny_model_dir, tmp_path):
    cfg_path = write_cfg(tmp_path, tiny_config)
    run = tmp_path / "run"
    held = Held(tmp_path / "held", "mudpuppy.training.results:write_summary", "before", "run", "-c", cfg_path)
    held.wait()                                       # the run is live: trained, its summary not yet written
    (run / "notes.md").write_text("mine\n")
    export = cli("export", tiny_model_dir, "--format", "gguf", "--out", run / "gguf")     # as docs/export.md shows
    assert export.returncode == 0, export.stderr
    code, _, err = held.release()
    assert code == 0, err
    marker = rundir.read_marker(run)
    assert not {"notes.md", "gguf"} & set(marker["written"])
    gguf = snapshot(run / "gguf")
    again = cli("run", "-c", cfg_path, "--overwrite")
    assert again.returncode == 0, again.stderr
    assert "kept 2 entries the previous run did not write: gguf, notes.md" in again.stdout
    assert (run / "notes.md").read_text() == "mine\n" and snapshot(run / "gguf") == gguf


def test_a_user_file_inside_the_runs_merged_model_survives_run_overwrite(tiny_config, tmp_path):
    cfg_path, run = trained(tmp_path, tiny_config, merge=True, merge_dtype="float32")
    (run / "merged" / "notes.md").write_text("mine\n")
    again = cli("run", "-c", cfg_path, "--overwrite")
    assert again.returncode == 0, again.stderr
    assert (run / "merged" / "notes.md").read_text() == "mine\n"
    assert (run / "merged" / "model.safetensors").is_file() and (run / "merged" / "tokenizer.json").is_file()
    assert "merged" in rundir.read_marker(run)["written"]
