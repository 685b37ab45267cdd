"""The quickstart on the real SmolLM2-135M-Instruct: the main job meets its targets. Minutes on a CPU."""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from mudpuppy.cli import main

from ..conftest import REPO

pytestmark = pytest.mark.slow


def test_quickstart_learns_the_task_in_under_ten_minutes(tmp_path):
    out = tmp_path / "quickstart"
    start = time.perf_counter()
    res = CliRunner().invoke(main, ["run", "-c", str(REPO / "configs" / "quickstart.yaml"),
                                    "--set", f"output_dir={out}", "--set", "logging.progress_bar=false"])
    seconds = time.perf_counter() - start
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "run_summary.json").read_text())
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["exact_match"] < 0.20
    assert after["exact_match"] >= 0.90
    assert after["loss"] < before["loss"] / 10
    assert seconds < 600, f"quickstart took {seconds:.0f} s"
    assert "exact match" in res.output


def test_quickstart_adapter_loads_in_plain_peft(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mudpuppy.backends.models import resolve_model

    out = tmp_path / "short"
    res = CliRunner().invoke(main, ["run", "-c", str(REPO / "configs" / "quickstart.yaml"),
                                    "--set", f"output_dir={out}", "--set", "training.max_steps=3",
                                    "--set", "eval.before_training=false", "--set", "eval.after_training=false",
                                    "--set", "logging.progress_bar=false"])
    assert res.exit_code == 0, res.output
    base = AutoModelForCausalLM.from_pretrained(str(resolve_model("smollm2-135m-instruct").path), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok("hello", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
