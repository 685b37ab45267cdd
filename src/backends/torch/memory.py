"""Fitting a run in device memory: which options a device can take, and running out of memory well.

Loading at storage precision lives in loading.py, host-resident frozen layers
in frozen.py, optimizer offload in optimizers.py; this module holds the
activation offload and the checks and messages they share.
"""

from __future__ import annotations

from ...errors import MudpuppyError


def check_memory_options(backend: str, memory, gpu: bool) -> None:
    """Refuse, before any model loads, offload or streaming on a device whose memory is host memory."""
    asked = memory.requested() if memory is not None else []
    if asked and not gpu:
        raise MudpuppyError(
            f"{', '.join(asked)}: the {backend} backend computes in host memory, so there is nothing to move there; "
            "offload and streaming are for ROCm and CUDA GPUs (turn them off on this backend)")
