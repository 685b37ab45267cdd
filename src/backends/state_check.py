"""Runtime-free checks on saved training state, shared by every backend."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..errors import MudpuppyError


def check_state_fits(path: Path, trainable: Iterable[str], stored: Iterable[str]) -> None:
    """Refuse a checkpoint whose tensors are not exactly this run's trainable ones, by name."""
    trainable, stored = list(trainable), list(stored)
    wanted, have = set(trainable), set(stored)
    missing = [n for n in trainable if n not in have]
    unexpected = [n for n in stored if n not in wanted]
    if missing or unexpected:
        example = (missing or unexpected)[0]
        raise MudpuppyError(
            f"checkpoint {path} does not fit this model and adapter "
            f"({len(missing)} trainable tensors missing, {len(unexpected)} unexpected, e.g. {example}); "
            "resume with the config that made it")
