"""Library log lines mudpuppy drops while it runs, and only while: nothing here acts at import.

Two warnings every run printed when transformers imports torchao, about nothing
mudpuppy uses: torchao cannot load the GPU-only kernel libraries its wheel ships
(CUDA fp8/cutlass on a CPU or ROCm build), and it registers enums with a
torch.compile API torch now deprecates. Only those messages are dropped; anything
else either logger says still shows. The CLI holds `import_noise_dropped()` for
its whole command and TorchBackend.load_model while it loads (the first import of
transformers' model code, which imports torchao, happens there); a program that
imports mudpuppy keeps its logging as it set it up.
"""

from __future__ import annotations

import contextlib
import logging

# logger name -> the part of a message that marks it as the noise above
NOISE = {"torchao": "Failed to load ", "torch.utils._pytree": "is an Enum subclass and is now natively"}


class DropMessages(logging.Filter):
    """Drops records whose message contains `needle`."""

    def __init__(self, needle: str):
        super().__init__()
        self.needle = needle

    def filter(self, record: logging.LogRecord) -> bool:
        return self.needle not in record.getMessage()


@contextlib.contextmanager
def import_noise_dropped():
    """Within: the NOISE messages are dropped; after, each logger has the filters it had before (this
    context's own filters are removed, so nested or overlapping holders leave each other's in place)."""
    installed = [(logging.getLogger(name), DropMessages(needle)) for name, needle in NOISE.items()]
    for logger, drop in installed:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in installed:
            logger.removeFilter(drop)
