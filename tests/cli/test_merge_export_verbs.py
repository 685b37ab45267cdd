"""`merge` and `export` as a newcomer meets them beside `eval` (issue 39): the run directory given
positionally, and a default output inside the run that the output contract guards like any --out."""

from __future__ import annotations

import yaml
from click.testing import CliRunner

import pytest

from mudpuppy.cli import main

from ..conftest import tiny_run_config


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("verbs")
    cfg = tiny_run_config(tiny_model_dir, root / "run")
    cfg["training"].update(max_steps=2)
    cfg["eval"] = {"before_training": False, "after_training": False}
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = CliRunner().invoke(main, ["run", "-c", str(path)])
    assert done.exit_code == 0, done.output
    return path, root / "run"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_merge_takes_the_run_directory_as_export_does(trained_run, tmp_path):
    cfg_path, run = trained_run
    by_dir = invoke("merge", run, "--out", tmp_path / "by-dir", "--dtype", "float32")
    assert by_dir.exit_code == 0, by_dir.output
    by_config = invoke("merge", "-c", cfg_path, "--out", tmp_path / "by-config", "--dtype", "float32")
    assert by_config.exit_code == 0, by_config.output           # the old spelling still works
    weights = "model.safetensors"
    assert (tmp_path / "by-dir" / weights).read_bytes() == (tmp_path / "by-config" / weights).read_bytes()


def test_merge_defaults_into_the_run_and_never_replaces_without_overwrite(trained_run):
    _, run = trained_run
    first = invoke("merge", run, "--dtype", "float32")
    assert first.exit_code == 0, first.output
    assert f"merged model saved to {run / 'merged'}" in first.output
    before = (run / "merged" / "model.safetensors").stat().st_mtime_ns
    again = invoke("merge", run)
    assert again.exit_code == 2 and "--overwrite" in again.output
    assert (run / "merged" / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize("args, says", [((), "one of them"), (("RUN", "-c", "CFG"), "one of them"),
                                        (("NOTRUN",), "not a run directory")])
def test_merge_names_what_is_wrong_with_its_arguments(trained_run, tmp_path, args, says):
    cfg_path, run = trained_run
    swap = {"RUN": run, "CFG": cfg_path, "NOTRUN": tmp_path}
    res = invoke("merge", *[swap.get(a, a) for a in args])
    assert res.exit_code == 2 and says in res.output and "Traceback" not in res.output


def test_export_defaults_to_a_folder_inside_the_run_named_by_format_and_quant(trained_run):
    _, run = trained_run
    out = run / "export" / "gguf-q8_0"
    first = invoke("export", run, "--format", "gguf", "--quant", "q8_0")
    assert first.exit_code == 0, first.output
    assert f"exported gguf to {out}" in first.output and list(out.glob("model-*.gguf"))
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = invoke("export", run, "--format", "gguf", "--quant", "q8_0")
    assert again.exit_code == 2 and "already holds" in again.output and "--overwrite" in again.output
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    replaced = invoke("export", run, "--format", "gguf", "--quant", "q8_0", "--overwrite")
    assert replaced.exit_code == 0, replaced.output


def test_export_of_a_model_directory_defaults_beside_the_command(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = invoke("export", tiny_model_dir, "--format", "gguf")
    assert res.exit_code == 0, res.output
    out = tmp_path / f"export-{tiny_model_dir.name}-gguf-f16"
    assert list(out.glob("model-*.gguf")) and (out / "export.json").is_file()


def test_export_refuses_a_bad_quant_before_choosing_a_folder(trained_run):
    _, run = trained_run
    res = invoke("export", run, "--format", "merged", "--quant", "q4_0")
    assert res.exit_code == 2 and "--quant is for" in res.output
    assert not (run / "export" / "merged").exists()
