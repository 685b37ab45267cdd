"""The output contract (src/output_dir/) for `export`, `eval --out` and `convert-adapter`, through the real
command line on the tiny model (issue 37, "Files lost"): a user's file in --out survives the export and
its --overwrite, one export at a time per folder, and what a killed export left is removed by the next."""

from __future__ import annotations

import json
import os

from ..conftest import QUICKSTART_DATA
from ..contract_helpers import Held, cli, dead_pid, hidden, one_error, snapshot

WRITE_FORMAT = "mudpuppy.export.pipeline:write_format"      # the format's files written, not yet in place
VAL = QUICKSTART_DATA / "smart_home_val.jsonl"


def gguf(source, out, *extra):
    return cli("export", source, "--format", "gguf", "--out", out, *extra)


def test_a_file_that_appears_in_out_during_an_export_survives(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    held = Held(tmp_path / "held", WRITE_FORMAT, "after", "export", tiny_model_dir, "--format", "gguf", "--out", out)
    held.wait()
    out.mkdir()                                   # the user makes --out and puts a file there meanwhile
    (out / "notes.md").write_text("mine\n")
    code, stdout, err = held.release()
    assert code == 0, err
    assert (out / "notes.md").read_text() == "mine\n" and (out / "model-f16.gguf").is_file()
    assert "notes.md" not in json.loads((out / "export.json").read_text())["files"]
    assert hidden(tmp_path) == []


def test_export_overwrite_replaces_only_the_earlier_exports_files(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    assert gguf(tiny_model_dir, out).returncode == 0
    (out / "notes.md").write_text("mine\n")
    (out / "extra").mkdir()
    (out / "extra" / "data.txt").write_text("mine too\n")
    one_error(gguf(tiny_model_dir, out), "--overwrite")
    done = cli("export", tiny_model_dir, "--format", "merged", "--out", out, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert (out / "notes.md").read_text() == "mine\n" and (out / "extra" / "data.txt").read_text() == "mine too\n"
    assert (out / "model.safetensors").is_file() and not (out / "model-f16.gguf").exists()   # the gguf export's
    # An export from before the contract (no "contract" in export.json), whose list names a file of the
    # user's: adopted for the files its format writes alone.
    record = json.loads((out / "export.json").read_text())
    record.pop("contract")
    record["files"].append("notes.md")
    (out / "export.json").write_text(json.dumps(record))
    assert gguf(tiny_model_dir, out, "--overwrite").returncode == 0
    assert (out / "notes.md").read_text() == "mine\n" and not (out / "model.safetensors").exists()


def test_two_exports_into_one_new_folder_never_both_succeed(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    first = Held(tmp_path / "held", WRITE_FORMAT, "after", "export", tiny_model_dir, "--format", "gguf",
                 "--out", out, "--quant", "q8_0")
    first.wait()
    second = gguf(tiny_model_dir, out, "--overwrite")
    one_error(second, "in use by another mudpuppy process", f"pid {first.pid}")
    code, _, err = first.release()
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "export.json", "model-q8_0.gguf"]
    assert hidden(tmp_path) == []


def test_a_killed_exports_staging_is_removed_by_the_next_export(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    held = Held(tmp_path / "held", WRITE_FORMAT, "after", "export", tiny_model_dir, "--format", "gguf", "--out", out)
    held.wait()
    held.kill()
    left = hidden(tmp_path)
    assert any(f"mudpuppy-new-{held.pid}" in name for name in left) and not out.exists()
    old_style = tmp_path / f".out.export-{dead_pid()}"      # what export left before the contract
    old_style.mkdir()
    (old_style / "model-f16.gguf").write_bytes(b"GGUF" + bytes(1024))
    done = gguf(tiny_model_dir, out)
    assert done.returncode == 0, done.stderr
    assert f"pid {held.pid}" in done.stdout and hidden(tmp_path) == []
    assert (out / "model-f16.gguf").is_file()


def test_eval_out_never_writes_over_a_users_file(tiny_model_dir, tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "eval.md").write_text("my own write-up\n")
    args = ("eval", tiny_model_dir, "--data", VAL, "--metrics", "perplexity", "--max-samples", 4, "--out", out)
    one_error(cli(*args), "eval.md", "did not write")
    assert (out / "eval.md").read_text() == "my own write-up\n"
    (out / "eval.md").rename(out / "notes.md")
    assert cli(*args).returncode == 0
    first = json.loads((out / "eval.json").read_text())
    assert sorted(first["files"]) == sorted(["eval.json", "eval.md", *first["charts"]])
    again = cli(*args, "--overwrite")
    assert again.returncode == 0, again.stderr
    assert (out / "notes.md").read_text() == "my own write-up\n" and hidden(tmp_path) == []


def test_convert_adapter_is_written_whole_and_cleans_a_killed_ones_staging(lora_run, tmp_path):
    dst = tmp_path / "mlx-adapter"
    stale = tmp_path / f".mlx-adapter.mudpuppy-new-{dead_pid()}"
    stale.mkdir()
    (stale / "adapters.safetensors").write_bytes(b"half")
    done = cli("convert-adapter", lora_run, dst, "--to", "mlx")
    assert done.returncode == 0, done.stderr
    assert hidden(tmp_path) == [] and (dst / "adapters.safetensors").is_file()
    before = snapshot(dst)
    one_error(cli("convert-adapter", lora_run, dst, "--to", "mlx"), "already exists")
    assert snapshot(dst) == before and os.listdir(tmp_path) == ["mlx-adapter"]
