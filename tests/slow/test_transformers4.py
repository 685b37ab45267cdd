"""What a run writes loads in transformers 4.x, which many serving stacks still pin, and computes there
what it computes here (transformers 5.x).

transformers 4.57 and PEFT run in a venv of their own (`MUDPUPPY_TRANSFORMERS4_PYTHON` names its python;
otherwise one is made once under ~/.cache/mudpuppy/venvs/transformers4 with pip, a few minutes the first
time). A LoRA run on the tiny model with `merge: true` is then read there: the run's tokenizer (the
chat template's ids), the run directory as a PEFT adapter (`AutoPeftModelForCausalLM`) and the merged
model (`AutoModelForCausalLM`), each giving the logits transformers 5.x gives here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mudpuppy import create_backend, load_config, run

pytestmark = pytest.mark.slow

VENV = Path.home() / ".cache" / "mudpuppy" / "venvs" / "transformers4"
MESSAGES = [{"role": "user", "content": "turn on the kitchen lights"}]

READER = r"""
import json, sys
import torch, transformers
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM, AutoTokenizer

run_dir, merged_dir, messages = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
tok = AutoTokenizer.from_pretrained(run_dir)
text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
ids = tok(text, add_special_tokens=False)["input_ids"]
batch = torch.tensor([ids])
with torch.no_grad():
    peft = AutoPeftModelForCausalLM.from_pretrained(run_dir, torch_dtype=torch.float32).eval()(batch).logits
    merged_model = AutoModelForCausalLM.from_pretrained(merged_dir, torch_dtype=torch.float32).eval()
    merged = merged_model(batch).logits
print(json.dumps({"version": transformers.__version__, "tokenizer": type(tok).__name__, "ids": list(ids),
                  "use_cache": merged_model.config.use_cache,
                  "peft": peft[0].tolist(), "merged": merged[0].tolist()}))
"""


def transformers4_python() -> str:
    given = os.environ.get("MUDPUPPY_TRANSFORMERS4_PYTHON")
    if given:
        return given
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        made = subprocess.run([str(python), "-m", "pip", "install", "-q", "transformers>=4.57,<5", "peft"],
                              capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"could not install transformers 4.x into {VENV}: {made.stderr[-500:]}")
    return str(python)


def read_with_transformers5(run_dir: Path, merged_dir: Path) -> dict:
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(run_dir))
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    batch = torch.tensor([list(ids)])
    with torch.no_grad():
        peft = AutoPeftModelForCausalLM.from_pretrained(str(run_dir), dtype=torch.float32).eval()(batch).logits
        merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()(batch).logits
    return {"ids": list(ids), "peft": peft[0].numpy(), "merged": merged[0].numpy()}


def test_a_run_and_its_merged_model_load_in_transformers4_with_the_same_logits(tiny_config):
    tiny_config["training"].update(max_steps=3, learning_rate=3e-2)
    tiny_config["eval"] = {"before_training": False, "after_training": False}
    tiny_config.update(merge=True, merge_dtype="float32")
    result = run(load_config(tiny_config), create_backend("cpu"), echo=lambda *_: None)
    run_dir, merged_dir = result.output_dir, result.output_dir / "merged"
    here = read_with_transformers5(run_dir, merged_dir)

    res = subprocess.run([transformers4_python(), "-c", READER, str(run_dir), str(merged_dir), json.dumps(MESSAGES)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    there = json.loads(res.stdout.strip().splitlines()[-1])
    assert there["version"].startswith("4."), there["version"]
    assert there["tokenizer"] == "PreTrainedTokenizerFast"
    assert there["ids"] == here["ids"]
    assert there["use_cache"] is True
    for key in ("peft", "merged"):
        np.testing.assert_allclose(np.array(there[key]), here[key], atol=1e-5, rtol=0, err_msg=key)
    # the merged model computes what the base with its adapter computes
    assert np.abs(here["merged"] - here["peft"]).max() < 1e-4
