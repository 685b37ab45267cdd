"""A run's config.yaml, loaded again (export's held-out scoring and --imatrix auto, eval, validate), finds
the data its run read: relative paths resolve against the folder of the config the run started from, as
they did for the run, not against the run directory."""

import shutil

import yaml

from mudpuppy.configure import load_config
from mudpuppy.output_dir.claim import write_config

CONFIG = """\
model:
  base_model: smollm2-135m-instruct
method: sft
adapter:
  type: lora
data:
  datasets:
    - path: data/train.jsonl
  val_datasets:
    - path: data/val.jsonl
output_dir: {out}
"""


def _project(tmp_path):
    proj = tmp_path / "project"
    (proj / "data").mkdir(parents=True)
    for name in ("train.jsonl", "val.jsonl"):
        (proj / "data" / name).write_text('{"text": "hello"}\n')
    out = tmp_path / "runs" / "one"
    out.mkdir(parents=True)
    (proj / "cfg.yaml").write_text(CONFIG.format(out=out))
    return proj, out


def test_a_run_config_resolves_data_where_its_run_did(tmp_path, monkeypatch):
    proj, out = _project(tmp_path)
    monkeypatch.chdir(tmp_path)                      # neither the project's nor the run's folder
    cfg = load_config(proj / "cfg.yaml", check_files=False)
    write_config(out, cfg)
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["source_dir"] == str(proj.resolve())
    again = load_config(out / "config.yaml", check_files=False)
    assert again.resolve_path(again.data.datasets[0].path) == proj.resolve() / "data" / "train.jsonl"
    assert again.resolve_path(again.data.val_datasets[0].path).is_file()
    assert "source_dir" not in again.dump() and again.dump() == cfg.dump()   # a loader's key, not a setting
    load_config(out / "config.yaml")                 # and the file checks pass


def test_without_the_recorded_folder_a_run_config_resolves_beside_itself(tmp_path, monkeypatch):
    proj, out = _project(tmp_path)
    monkeypatch.chdir(tmp_path)
    write_config(out, load_config(proj / "cfg.yaml", check_files=False))
    shutil.copytree(proj / "data", out / "data")     # a run copied elsewhere with its data beside it
    shutil.rmtree(proj)
    again = load_config(out / "config.yaml", check_files=False)
    assert again.resolve_path(again.data.datasets[0].path) == out.resolve() / "data" / "train.jsonl"


def test_a_config_built_in_python_records_no_folder(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    raw = yaml.safe_load(CONFIG.format(out=out))
    write_config(out, load_config(raw, check_files=False))
    assert "source_dir" not in yaml.safe_load((out / "config.yaml").read_text())
