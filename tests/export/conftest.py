"""A two-step LoRA run of the tiny model (trained through the CLI, with a chat template that is not
the tokenizer's own), its merge by plain PEFT as the oracle, and the export command."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from mudpuppy.cli import main

from ..conftest import tiny_run_config

# The run trains with zephyr's layout; the tiny tokenizer's own template is chatml.
RUN_TEMPLATE = "zephyr"


def mudpuppy(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def trained_run(root: Path, model_dir: Path, training: dict, data: dict | None = None,
                adapter: dict | None = None) -> Path:
    """`mudpuppy run` of the tiny run config on `model_dir` in `root` (its training settings updated by
    `training`, data by `data`, the adapter section replaced by `adapter`; no evaluation, no data cache);
    returns the run directory."""
    cfg = tiny_run_config(model_dir, root / "run")
    cfg["training"].update(training)
    cfg["eval"] = {"before_training": False, "after_training": False}
    cfg["data"].update(cache=False, **(data or {}))
    if adapter is not None:
        cfg["adapter"] = adapter
    (root / "run.yaml").write_text(yaml.safe_dump(cfg))
    done = mudpuppy("run", "-c", root / "run.yaml")
    assert done.exit_code == 0, done.output
    return root / "run"


@pytest.fixture(scope="session")
def lora_run(tiny_model_dir, tmp_path_factory) -> Path:
    return trained_run(tmp_path_factory.mktemp("export-run"), tiny_model_dir, dict(max_steps=2, learning_rate=5e-2),
                       data=dict(chat_template=RUN_TEMPLATE))


@pytest.fixture(scope="session")
def peft_merged(tiny_model_dir, lora_run):
    """The run's adapter folded into the base by PEFT alone, in float32, with the run's tokenizer."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(lora_run)).merge_and_unload().eval()
    return model, AutoTokenizer.from_pretrained(str(lora_run))


def logits(model, ids) -> "object":
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def greedy(model, ids, n: int, stop: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, eos_token_id=[stop], pad_token_id=stop)
    return out[0, len(ids):].tolist()


def export_quantized(model_dir: Path, src: Path, tensors: dict, quantization_config: dict) -> tuple[Path, dict]:
    """`tensors` (numpy) saved as a quantized model directory `src` (model_dir's config with
    `quantization_config`, its tokenizer), then `mudpuppy export --format merged --dtype fp32` of it:
    (the export's directory, its tensors)."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    from mudpuppy.export import ExportRequest, export_model

    src.mkdir(exist_ok=True)
    save_file(tensors, str(src / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (src / "config.json").write_text(json.dumps(config))
    for f in model_dir.glob("tokenizer*"):
        shutil.copy(f, src / f.name)
    out = src.parent / f"{src.name}-merged"
    export_model(ExportRequest(str(src), "merged", str(out), dtype="fp32"), echo=lambda *_a, **_k: None)
    return out, load_file(str(out / "model.safetensors"))
