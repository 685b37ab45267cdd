"""mudpuppy: fine-tune language models on ROCm, CUDA, CPU and MLX from one YAML file.

    from mudpuppy import load_config, create_backend, run
    cfg = load_config("configs/quickstart.yaml", overrides=["training.max_steps=5"])
    result = run(cfg, create_backend("cpu"))
"""

import logging


class _DropImportNoise(logging.Filter):
    """Two warnings every run printed when transformers imports torchao, about nothing mudpuppy
    uses: torchao cannot load the GPU-only kernel libraries its wheel ships (CUDA fp8/cutlass on a
    CPU or ROCm build), and it registers enums with a torch.compile API torch now deprecates.
    Only those messages are dropped; anything else either logger says still shows."""

    def __init__(self, *needles: str):
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(needle in message for needle in self.needles)


logging.getLogger("torchao").addFilter(_DropImportNoise("Failed to load "))
logging.getLogger("torch.utils._pytree").addFilter(_DropImportNoise("is an Enum subclass and is now natively"))

from .backends import create_backend, probe_all  # noqa: E402
from .config import RunConfig  # noqa: E402
from .configure import load_config  # noqa: E402
from .errors import BackendUnavailable, ConfigError, DataError, ModelNotFound, MudpuppyError  # noqa: E402
from .training import run  # noqa: E402
from .training.curriculum import load_curriculum, run_curriculum  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "create_backend", "probe_all", "RunConfig", "load_config", "run", "load_curriculum", "run_curriculum",
    "MudpuppyError", "ConfigError", "DataError", "BackendUnavailable", "ModelNotFound",
]
