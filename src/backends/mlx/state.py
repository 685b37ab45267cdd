"""Training state on disk for the MLX backend: trainable weights, optimizer, RNG.

The same layout idea as the torch backend's: the trainable parameters by
their exact names (a strict, name-checked copy on load), the optimizer's
arrays, and the trainer's small state as JSON. With an adapter attached the
checkpoint is also a PEFT (and mlx-lm) adapter directory.

Beside its own files a checkpoint holds the runtime-neutral state of
backends/portable_state.py (PEFT names and layout, float32 moments in torch's
vocabulary, JSON counts), which a resume on torch reads; a checkpoint torch
wrote resumes here from its portable state.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ...errors import MudpuppyError
from ...files import CorruptFile, check_safetensors, check_zip, read_json
from .. import portable_state as portable
from ..adapters import PEFT_PREFIX
from ..state_check import check_state_fits
from .adapter_io import from_raw, to_raw
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
    portable.write_state(path, portable_state(handle, trainer, state["optimizer"]))
    if adapter_layers(handle.model) or expert_adapters(handle.model):
        backend.save_adapter(handle, str(path))


def load_training_state(backend, handle, trainer, path: str | Path) -> None:
    path = Path(path)
    foreign = portable.foreign_state(path, "mlx", trainer.cfg.optimizer)
    if foreign is not None:
        load_portable(handle, trainer, path, foreign)
        return
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


# ------------------------------------------------------------------ the runtime-neutral copy

# MLX's names for each optimizer's moments -> torch's, which the portable state uses.
MOMENT_NAMES = {"adamw": {"m": "exp_avg", "v": "exp_avg_sq"}, "sgd": {"v": "momentum_buffer"},
                "adafactor": {k: k for k in portable.MOMENTS["adafactor"]}}
LORA = {"lora_a": "lora_A.weight", "lora_b": "lora_B.weight"}


def portable_slots(model) -> list[portable.Slot]:
    """Each trainable array under the name PEFT saves it by (mlx-lm's lora_a [in, r] is PEFT's lora_A [r, in]
    transposed; a DoRA magnitude m is lora_magnitude_vector; a head or router trained in full beside the
    adapter keeps its module's name), or its own name in full fine-tuning."""
    layers = adapter_layers(model)
    slots = []
    for name, _ in tree_flatten(model.trainable_parameters()):
        path, _, leaf = name.rpartition(".")
        if path in layers and leaf in LORA:
            slots.append(portable.Slot(name, f"{PEFT_PREFIX}{path}.{LORA[leaf]}", transposed=True))
        elif path in layers and leaf == "m":
            slots.append(portable.Slot(name, f"{PEFT_PREFIX}{path}.lora_magnitude_vector"))
        else:
            slots.append(portable.Slot(name, f"{PEFT_PREFIX}{name}" if layers else name))
    return slots


def why_not_portable(handle) -> str | None:
    """Why this run's state has no equivalent on another runtime, or None."""
    if (handle.adapter or {}).get("quantization"):
        return ("the frozen base was quantized by MLX (adapter.type qlora, or a quantized model), and another "
                "runtime's quantized base holds other values, so the adapter would go on training against another "
                "model")
    if expert_adapters(handle.model):
        return "LoRA on fused mixture-of-experts tensors is not carried between runtimes"
    return None


def portable_state(handle, trainer, arrays: dict) -> portable.PortableState:
    """This run's trainable arrays and optimizer moments (`arrays`: trainer.state_dict()'s) in PEFT's layout."""
    name = trainer.cfg.optimizer
    state = portable.PortableState("mlx", "mlx", name, refused=why_not_portable(handle))
    if state.refused is not None:
        return state
    weights = dict(tree_flatten(handle.model.trainable_parameters()))
    names = MOMENT_NAMES[name]
    if name == "sgd" and not getattr(trainer.cfg, "momentum", 0.0):
        names = {}                      # MLX keeps a zero buffer; torch keeps none
    for slot in portable_slots(handle.model):
        moments = {torch_name: arrays[f"{slot.native}.{own}"] for own, torch_name in names.items()
                   if f"{slot.native}.{own}" in arrays}
        weight, moments = portable.to_portable(slot, to_raw(weights[slot.native]), moments)
        state.weights[slot.name], state.moments[slot.name] = weight, moments
        if "step" in arrays and moments:
            state.steps[slot.name] = int(arrays["step"])
    return state


def load_portable(handle, trainer, path: Path, state: portable.PortableState) -> None:
    """Weights and optimizer state written by another runtime; the dropout RNG goes on from this run's seed."""
    if (problem := why_not_portable(handle)) is not None:
        raise MudpuppyError(f"cannot resume checkpoint {path} (written by the {state.backend} backend) on mlx: "
                            f"{problem}")
    slots = portable_slots(handle.model)
    check_state_fits(path, [s.name for s in slots], state.weights)
    current = dict(tree_flatten(handle.model.trainable_parameters()))
    own = {t: m for m, t in MOMENT_NAMES[trainer.cfg.optimizer].items()}
    weights, arrays, narrow = [], {}, {}
    for slot in slots:
        weight, moments = portable.to_native(slot, state.weights[slot.name], state.moments.get(slot.name, {}))
        weights.append((slot.native, from_raw(weight).astype(current[slot.native].dtype)))
        for torch_name, value in moments.items():
            key = f"{slot.native}.{own[torch_name]}"
            arrays[key] = value
            if current[slot.native].dtype == mx.bfloat16:
                narrow[key] = "bfloat16"
    handle.model.load_weights(weights, strict=False)
    count = portable.single_step_count(path, state)
    if arrays:
        arrays["step"] = np.array(count, np.uint64)
        arrays["learning_rate"] = np.array(trainer.cfg.learning_rate, np.float32)
    trainer.load_state_dict({"optimizer": arrays, "optimizer_dtypes": narrow,
                             "rng": {"seed": trainer.seed, "steps": count}})
    mx.eval(handle.model.parameters())
