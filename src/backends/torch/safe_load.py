"""torch.load for the files mudpuppy writes (optimizer state, RNG streams): tensors and plain containers
only, so a file that holds more (and could run code when unpickled) is refused, and one that fails is
named in one message. A leaf: the single-process (state.py) and sharded (distributed.py) checkpoints
both read through it."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from ...files import CorruptFile


def load_torch_file(path: Path):
    """torch.load restricted to tensors and plain containers; a file that fails is named in one message."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CorruptFile(f"{path}: cannot be loaded ({first}); it is damaged, cut short, or holds more than "
                          "tensors (such a file can run code when read, so it is refused)") from None
