"""Training state on disk for the MLX backend: trainable weights, optimizer, RNG.

The same layout idea as the torch backend's: the trainable parameters by
their exact names (a strict, name-checked copy on load), the optimizer's
arrays, and the trainer's small state as JSON. With an adapter attached the
checkpoint is also a PEFT (and mlx-lm) adapter directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ...files import CorruptFile, check_safetensors, check_zip, read_json
from ..state_check import check_state_fits
from .experts import expert_adapters
from .layers import adapter_layers

WEIGHTS = "trainable.safetensors"
OPTIMIZER = "optimizer.npz"
TRAINER = "trainer.json"


def save_training_state(backend, handle, trainer, path: str | Path) -> None:
    path = Path(path)
    mx.save_safetensors(str(path / WEIGHTS), dict(tree_flatten(handle.model.trainable_parameters())))
    state = trainer.state_dict()
    np.savez(path / OPTIMIZER, **state["optimizer"])
    (path / TRAINER).write_text(json.dumps({"optimizer_dtypes": state["optimizer_dtypes"], "rng": state["rng"]}))
    if adapter_layers(handle.model) or expert_adapters(handle.model):
        backend.save_adapter(handle, str(path))


def load_training_state(backend, handle, trainer, path: str | Path) -> None:
    path = Path(path)
    # Checked before mlx or numpy read them: a damaged file ends in one message naming it.
    check_safetensors(path / WEIGHTS)
    check_zip(path / OPTIMIZER)
    small = read_json(path / TRAINER)
    weights = mx.load(str(path / WEIGHTS))
    trainable = dict(tree_flatten(handle.model.trainable_parameters()))
    check_state_fits(path, trainable, weights)
    handle.model.load_weights(list(weights.items()), strict=False)
    try:
        with np.load(path / OPTIMIZER) as stored:       # allow_pickle stays False: arrays only
            optimizer = {k: stored[k] for k in stored.files}
    except (OSError, ValueError, EOFError) as exc:
        raise CorruptFile(f"{path / OPTIMIZER}: cannot be loaded ({exc}); the file is damaged or cut short") from None
    trainer.load_state_dict({"optimizer": optimizer, **small})
    mx.eval(handle.model.parameters())
