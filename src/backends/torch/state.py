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
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...errors import MudpuppyError
from ...files import CorruptFile, check_safetensors, check_torch_file
from ..state_check import check_state_fits
from .safe_load import load_torch_file

WEIGHTS = "trainable.safetensors"
TRAINER = "trainer.pt"


def save_training_state(backend, handle, trainer, path: str | Path) -> None:
    path = Path(path)
    model = handle.model
    if trainer.engine is not None:
        from .distributed import save_sharded

        save_sharded(handle, trainer, path)
        if hasattr(model, "peft_config"):
            backend.save_adapter(handle, str(path))      # gathered; rank 0 writes
        return
    tensors = {n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters() if p.requires_grad}
    save_file(tensors, str(path / WEIGHTS))
    torch.save(trainer.state_dict(), path / TRAINER)
    if hasattr(model, "peft_config"):
        # A checkpoint doubles as a usable PEFT adapter directory.
        backend.save_adapter(handle, str(path))


def load_training_state(backend, handle, trainer, path: str | Path) -> None:
    from .distributed import is_sharded, load_sharded

    path = Path(path)
    if is_sharded(path):
        if (path / WEIGHTS).exists():
            raise CorruptFile(f"{path} holds both {WEIGHTS} (written by one process) and sharded/ (written by "
                              "several); no run writes both, so it was changed after it was written and is not read")
        load_sharded(handle, trainer, path)
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
