"""Model code shipped beside weights (config.json's auto_map) runs only when the command asks for it.

A run directory is only read by eval, export, chat and serve: its config.yaml's
`model.trust_remote_code: true` must not be enough to run code. Each test plants a
Python file that would write a sentinel file when imported; the sentinel proves
whether it ran.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from mudpuppy.cli import main

from .conftest import VAL

CUSTOM_CODE = '''
import os, pathlib
pathlib.Path(os.environ["MUDPUPPY_TEST_SENTINEL"]).write_text("ran")
from transformers import LlamaConfig, LlamaForCausalLM


class PlantedConfig(LlamaConfig):
    model_type = "llama"


class PlantedModel(LlamaForCausalLM):
    config_class = PlantedConfig
'''


def plant_code(model_dir: Path) -> None:
    (model_dir / "planted.py").write_text(CUSTOM_CODE)
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "planted.PlantedConfig", "AutoModelForCausalLM": "planted.PlantedModel"}
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.fixture()
def sentinel(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "sentinel"
    monkeypatch.setenv("MUDPUPPY_TEST_SENTINEL", str(path))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    return path


@pytest.fixture()
def shared_run(tiny_runs, tiny_model_dir, tmp_path) -> Path:
    """A run directory as someone else might share it: its config asks for remote code, and its base
    (copied beside it) declares an auto_map whose module would run on import."""
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    plant_code(base)
    run = tmp_path / "shared-run"
    shutil.copytree(tiny_runs[0], run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"].update(base_model=str(base), trust_remote_code=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    return run


@pytest.fixture()
def planted_model(tiny_model_dir, tmp_path) -> Path:
    model = tmp_path / "planted-model"
    shutil.copytree(tiny_model_dir, model)
    plant_code(model)
    return model


def invoke(*args) -> object:
    return CliRunner().invoke(main, [*map(str, args)])


@pytest.mark.parametrize("verb", ["eval", "export"])
def test_a_run_directory_never_runs_code_by_itself(verb, shared_run, sentinel, tmp_path):
    args = (["eval", shared_run, "--data", VAL, "--out", tmp_path / "out"] if verb == "eval"
            else ["export", shared_run, "--format", "merged", "--out", tmp_path / "out"])
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert "--trust-remote-code" in result.output and "trust_remote_code: true" in result.output
    assert "Traceback" not in result.output
    assert not sentinel.exists()
    assert not (tmp_path / "out").exists()


def test_chat_and_serve_loading_refuses_the_run_too(shared_run, sentinel):
    from mudpuppy.errors import MudpuppyError
    from mudpuppy.serving import load_chat_model

    with pytest.raises(MudpuppyError, match="--trust-remote-code"):
        load_chat_model(str(shared_run), "cpu", "fp32")
    assert not sentinel.exists()


def test_a_model_directory_with_auto_map_is_refused_without_the_flag(planted_model, sentinel, tmp_path):
    result = invoke("eval", planted_model, "--data", VAL, "--out", tmp_path / "out", "--max-samples", "2")
    assert result.exit_code == 2, result.output
    assert "auto_map" in result.output and "--trust-remote-code" in result.output
    assert not sentinel.exists()


def test_the_flag_is_what_lets_code_run(planted_model, sentinel):
    """--trust-remote-code reaches the loader: the planted module is imported (and so it runs)."""
    from mudpuppy import create_backend
    from mudpuppy.evaluation.targets import resolve_target

    column = resolve_target(str(planted_model), None, None, trust_remote_code=True)
    assert column.cfg.model.trust_remote_code
    column.load(create_backend("cpu"), "fp32")
    assert sentinel.read_text() == "ran"


def test_the_config_being_run_still_decides_for_training(tiny_config):
    """`mudpuppy run cfg.yaml` is the user asking: the key in the config being run is honoured."""
    from mudpuppy import load_config

    tiny_config["model"]["trust_remote_code"] = True
    assert load_config(tiny_config).model.trust_remote_code is True
