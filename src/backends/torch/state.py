"""Training state on disk for the torch backends: trainable weights, optimizer, RNG.

Only parameters that train are saved (the LoRA matrices, or every weight in
full fine-tuning), keyed by their exact parameter names, so loading is a
strict, name-checked copy and resume continues bit for bit.

A distributed run writes the same state sharded, with torch.distributed.checkpoint
(distributed.py); a checkpoint of either kind loads here, so one written by N
processes resumes in one process, or in M.

A checkpoint is one kind or the other, never both: one holding
trainable.safetensors and a `sharded/` directory was changed after it was
written and is refused (training/checkpoints.py skips it on --resume), so a
`sharded/` planted beside a single process's files is never unpickled. A
sharded checkpoint goes through DCP, whose metadata is unpickled through an
allow-list (distributed.py). Every file is checked before it is read
(files.py), and a torch file that still fails to load is named in one message.

Beside its own files a checkpoint holds the runtime-neutral state of
backends/portable_state.py (PEFT names, float32 moments, JSON counts), which a
resume on MLX reads; a checkpoint MLX wrote resumes here from its portable
state. Between torch devices (cpu, cuda, rocm) the own files carry as they
are: tensors load onto the CPU first, and the CUDA generator's state of a GPU
run is set lazily, so a machine without a GPU never applies it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ...errors import MudpuppyError
from ...files import CorruptFile, check_safetensors, check_torch_file
from .. import portable_state as portable
from ..adapters import RawTensor
from ..state_check import check_state_fits
from .optimizers import LOW_BIT, state_order
from .safe_load import load_torch_file

WEIGHTS = "trainable.safetensors"
TRAINER = "trainer.pt"


def save_training_state(backend, handle, trainer, path: str | Path) -> None:
    path = Path(path)
    model = handle.model
    if trainer.engine is not None:
        from .distributed import save_sharded

        save_sharded(handle, trainer, path, backend.ranks.rank)
        if hasattr(model, "peft_config"):
            backend.save_adapter(handle, str(path))      # gathered; rank 0 writes
        write_gathered_portable(backend, handle, trainer, path)
        return
    tensors = {n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters() if p.requires_grad}
    save_file(tensors, str(path / WEIGHTS))
    state = trainer.state_dict()
    torch.save(state, path / TRAINER)
    portable.write_state(path, portable_state(backend, handle, trainer, state["optimizer"]["state"]))
    if hasattr(model, "peft_config"):
        # A checkpoint doubles as a usable PEFT adapter directory.
        backend.save_adapter(handle, str(path))


def load_training_state(backend, handle, trainer, path: str | Path) -> None:
    from .distributed import is_sharded, load_sharded

    path = Path(path)
    foreign = portable.foreign_state(path, backend.plan.name, trainer.cfg.optimizer)
    if foreign is not None:
        load_portable(handle, trainer, path, foreign)
        return
    if is_sharded(path):
        if (path / WEIGHTS).exists():
            raise CorruptFile(f"{path} holds both {WEIGHTS} (written by one process) and sharded/ (written by "
                              "several); no run writes both, so it was changed after it was written and is not read")
        load_sharded(handle, trainer, path, backend.ranks.rank)
        return
    if trainer.engine is not None and trainer.engine.strategy == "fsdp":
        raise MudpuppyError(f"cannot resume {path} under fsdp: it was written by one process (not sharded); "
                            "resume it in one process or under distributed.strategy: ddp")
    check_safetensors(path / WEIGHTS)
    check_torch_file(path / TRAINER)
    tensors = load_file(str(path / WEIGHTS))
    params = dict(handle.model.named_parameters())
    check_state_fits(path, [n for n, p in params.items() if p.requires_grad], tensors)
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
    trainer.load_state_dict(load_torch_file(path / TRAINER))


# ------------------------------------------------------------------ the runtime-neutral copy

def portable_slots(model) -> list[portable.Slot]:
    """Each trainable parameter under the name PEFT saves it by (its adapter's name taken out: lora_A.weight,
    lora_magnitude_vector, a modules_to_save head under its own name), or its own name in full fine-tuning."""
    adapter = next(iter(model.peft_config), None) if hasattr(model, "peft_config") else None
    return [portable.Slot(n, peft_name(n, adapter)) for n, p in model.named_parameters() if p.requires_grad]


def peft_name(name: str, adapter: str | None) -> str:
    if adapter is None:
        return name
    name = name.replace(f".modules_to_save.{adapter}.", ".").replace(f".{adapter}.", ".")
    return name.removesuffix(".weight") if name.endswith(".lora_magnitude_vector.weight") else name


def why_not_portable(handle, trainer) -> str | None:
    """Why this run's state has no equivalent on another runtime, or None."""
    name = trainer.cfg.optimizer
    if name in LOW_BIT:
        return (f"training.optimizer {name} keeps its moments block-quantized by torchao, which no other runtime "
                "has; resume on another runtime from a run trained with adamw")
    if hasattr(trainer.optimizer, "param_d2h_map"):
        return ("memory.optimizer_offload ran torchao's CPUOffloadOptimizer, whose state has a layout of its own; "
                "a run with max_grad_norm set uses mudpuppy's own offload, whose state carries")
    if handle.adapter_type == "qlora":
        return ("adapter.type qlora: the frozen base was quantized to 4 bits by the torch backend, and another "
                "runtime's 4-bit base holds other values, so the adapter would go on training against another model")
    config = getattr(handle.model, "peft_config", {})
    if any(getattr(c, "target_parameters", None) for c in config.values()):
        return "LoRA on fused mixture-of-experts tensors (target_parameters) is not carried between runtimes"
    return None


def portable_state(backend, handle, trainer, optimizer_state: dict) -> portable.PortableState:
    """This run's trainable tensors and optimizer moments in PEFT's names and layout."""
    params = dict(handle.model.named_parameters())
    slots = portable_slots(handle.model)
    order = state_order(trainer.optimizer, [params[slot.native] for slot in slots])
    entries = ((slot.name, params[slot.native], optimizer_state.get(order[index], {}))
               for index, slot in enumerate(slots))
    return collect(backend, handle, trainer, entries)


def write_gathered_portable(backend, handle, trainer, path: Path) -> None:
    """A distributed run's portable state: every rank's shards gathered (a collective) to rank 0, which
    writes it; another runtime resumes from it in one process, with no torch.distributed to read DCP."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    )

    entries = []
    # A full fine-tune's whole model and optimizer state would have to fit in rank 0's host memory at every
    # checkpoint (about 16 bytes a parameter); an adapter's is small.
    unsharded = None if hasattr(handle.model, "peft_config") else (
        "a distributed full fine-tune is not gathered into one portable copy at each checkpoint (the whole model "
        "and its optimizer state would have to fit in rank 0's memory); resume it on torch")
    if unsharded is None and why_not_portable(handle, trainer) is None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        weights = get_model_state_dict(handle.model, options=options)        # empty on ranks but 0
        optimizer = get_optimizer_state_dict(handle.model, trainer.optimizer, options=options).get("state", {})
        adapter = next(iter(handle.model.peft_config), None) if hasattr(handle.model, "peft_config") else None
        stepped = {id(p) for p in trainer.params}     # what the optimizer updates (a tied frozen head is not)
        trained = {n for n, p in handle.model.named_parameters() if id(p) in stepped}
        entries = [(peft_name(n, adapter), t, optimizer.get(n, {})) for n, t in weights.items() if n in trained]
    state = collect(backend, handle, trainer, entries, refused=unsharded)
    if backend.ranks.is_main:
        portable.write_state(path, state)


def collect(backend, handle, trainer, entries, refused: str | None = None) -> portable.PortableState:
    """The portable state from (portable name, tensor, its torch.optim state) of each trainable tensor."""
    state = portable.PortableState("torch", backend.plan.name, trainer.cfg.optimizer,
                                   refused=refused or why_not_portable(handle, trainer))
    if state.refused is not None:
        return state
    moments = portable.MOMENTS[trainer.cfg.optimizer]
    for name, tensor, kept in entries:
        state.weights[name] = raw_tensor(tensor)
        state.moments[name] = {k: v.detach().to("cpu", torch.float32).numpy()
                               for k, v in kept.items() if k in moments and v is not None}
        if "step" in kept:
            state.steps[name] = int(float(kept["step"]))
    return state


def load_portable(handle, trainer, path: Path, state: portable.PortableState) -> None:
    """Weights and optimizer state written by another runtime; this process's RNG goes on as seeded."""
    if trainer.engine is not None:
        raise MudpuppyError(f"cannot resume checkpoint {path} in a distributed run: it was written by the "
                            f"{state.backend} backend; resume it in one process, whose checkpoints then resume "
                            "distributed")
    if hasattr(trainer.optimizer, "param_d2h_map"):
        raise MudpuppyError(f"cannot resume checkpoint {path} (written by the {state.backend} backend) into torchao's "
                            "CPUOffloadOptimizer, whose state has a layout of its own; resume with max_grad_norm "
                            "set (mudpuppy's own offload) or without memory.optimizer_offload")
    slots = portable_slots(handle.model)
    check_state_fits(path, [s.name for s in slots], state.weights)
    params = dict(handle.model.named_parameters())
    with torch.no_grad():
        for slot in slots:
            param = params[slot.native]
            param.copy_(torch_tensor(state.weights[slot.name]).to(param.device, param.dtype))
    groups = trainer.optimizer.state_dict()["param_groups"]
    order = state_order(trainer.optimizer, [params[s.native] for s in slots])
    entries = {order[i]: optimizer_entry(trainer.cfg, state, s.name) for i, s in enumerate(slots)}
    trainer.optimizer.load_state_dict({"state": {i: e for i, e in entries.items() if e}, "param_groups": groups})


def optimizer_entry(cfg, state: portable.PortableState, name: str) -> dict:
    """torch.optim's state of one parameter from its portable moments ({} for one not updated yet)."""
    moments = {k: torch.from_numpy(v) for k, v in state.moments.get(name, {}).items()}
    if cfg.optimizer == "sgd":
        return {"momentum_buffer": moments.get("momentum_buffer")} if name in state.moments else {}
    if name not in state.steps:
        return {}
    return {"step": torch.tensor(float(state.steps[name]), dtype=torch.float32), **moments}


def raw_tensor(tensor: torch.Tensor) -> RawTensor:
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype == torch.bfloat16:
        return RawTensor("BF16", tensor.view(torch.int16).numpy().view(np.uint16).copy())
    if tensor.dtype == torch.float16:
        return RawTensor("F16", tensor.numpy().copy())
    return RawTensor("F32", tensor.to(torch.float32).numpy().copy())


def torch_tensor(raw: RawTensor) -> torch.Tensor:
    if raw.dtype == "BF16":
        return torch.from_numpy(raw.array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(raw.array))
