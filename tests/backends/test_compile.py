"""training.compile: true (regional torch.compile of the decoder layers) trains like eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mudpuppy import create_backend, load_config, run
from mudpuppy.backends.torch.compile import TrainingForward, compile_layers
from mudpuppy.errors import MudpuppyError

QUIET = {"echo": lambda *_: None}


def train(cfg: dict, tmp_path, name: str, compile_: bool):
    cfg = {**cfg, "output_dir": str(tmp_path / name), "eval": {"before_training": False, "after_training": False},
           "training": {**cfg["training"], "max_steps": 4, "compile": compile_}}
    result = run(load_config(cfg), create_backend("cpu"), **QUIET)
    return result, {n: p.detach().clone() for n, p in result.model.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_compiled_layers_train_like_eager(tiny_config, tmp_path, adapter):
    tiny_config["adapter"] = {"type": adapter, "r": 4, "alpha": 8}
    eager, eager_w = train(tiny_config, tmp_path, "eager", False)
    compiled, compiled_w = train(tiny_config, tmp_path, "compiled", True)
    layers = compiled.model.model.get_base_model().model.layers
    assert all(isinstance(layer.forward, TrainingForward) for layer in layers)
    # Fused kernels reorder float sums: equal within rounding, not bit for bit.
    np.testing.assert_allclose(compiled.losses, eager.losses, rtol=1e-4)
    for name in eager_w:
        torch.testing.assert_close(compiled_w[name], eager_w[name], rtol=1e-3, atol=1e-5, msg=name)


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(MudpuppyError, match="training.compile: no transformer decoder layers"):
        compile_layers(torch.nn.Sequential(torch.nn.Linear(4, 4)), backend="cpu")
