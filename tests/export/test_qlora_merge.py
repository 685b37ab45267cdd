"""A QLoRA run exports merged into its dequantized base: plain float weights that compute what the
4-bit base with the adapter computed, not the adapter on the original float base."""

from __future__ import annotations

import json

import numpy as np

from mudpuppy import create_backend, load_config, run
from mudpuppy.export import ExportRequest, export_model

from ..conftest import tiny_run_config
from .conftest import logits


def test_a_qlora_run_merges_into_the_dequantized_base(tiny_model_dir, tmp_path, monkeypatch):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mudpuppy.backends.torch.quantization import linear4bit as quantize

    # The eager dequantizer (the compiled one gives the same values bit for bit, and costs a compile here).
    monkeypatch.setenv(quantize.EAGER_ENV, "1")

    from mudpuppy.data.batch import Batch
    from mudpuppy.evaluation.targets import run_column

    cfg = tiny_run_config(tiny_model_dir, tmp_path / "qlora")
    cfg["adapter"] = {"type": "qlora", "r": 4, "alpha": 8, "quant_group_size": 16}
    cfg["training"].update(max_steps=2, learning_rate=5e-2)
    cfg["eval"] = {"before_training": False, "after_training": False}
    cfg["data"]["cache"] = False
    run(load_config(cfg), create_backend("cpu"), echo=lambda *_a, **_k: None)

    out = tmp_path / "merged"
    export_model(ExportRequest(str(tmp_path / "qlora"), "merged", str(out), dtype="fp32"), echo=lambda *_a, **_k: None)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert all(p.dtype == torch.float32 for p in merged.parameters())

    ids = list(range(5, 40))
    # The run as it trained: the 4-bit base with the adapter, through the backend.
    backend = create_backend("cpu")
    handle = run_column(str(tmp_path / "qlora"), tmp_path / "qlora").load(backend, "fp32")
    batch = Batch(input_ids=np.array([ids]), attention_mask=np.ones((1, len(ids)), dtype=np.int64),
                  labels=np.array([ids]))
    trained = backend.logits(handle, batch)[0]
    assert np.abs(logits(merged, ids) - trained).max() < 1e-4
    # The same adapter on the float base computes something else: the comparison above can tell.
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    on_float = PeftModel.from_pretrained(base, str(tmp_path / "qlora")).merge_and_unload().eval()
    assert np.abs(logits(on_float, ids) - trained).max() > 1e-3
