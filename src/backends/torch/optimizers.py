"""Optimizers for the torch backends: AdamW, SGD, Adafactor, torchao's low-bit AdamW, and host offload."""

from __future__ import annotations

import importlib.util

from ...errors import MudpuppyError

LOW_BIT = {"adamw_8bit": "AdamW8bit", "adamw_4bit": "AdamW4bit"}
TORCHAO_INSTALL = "pip install 'mudpuppy[torchao]'  (or: pip install torchao)"


def check_optimizer(backend: str, name: str) -> None:
    """Refuse, before any model loads, an optimizer this backend cannot run."""
    if name in LOW_BIT and importlib.util.find_spec("torchao") is None:
        raise MudpuppyError(f"training.optimizer: {name} on the {backend} backend uses torchao's {LOW_BIT[name]}, "
                            f"and torchao is not installed; install it with {TORCHAO_INSTALL}, or use adamw")
