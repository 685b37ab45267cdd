"""mudpuppy: fine-tune language models on ROCm, CUDA, CPU and MLX from one YAML file.

    from mudpuppy import load_config, create_backend, run
    cfg = load_config("configs/quickstart.yaml", overrides=["training.max_steps=5"])
    result = run(cfg, create_backend("cpu"))
"""

from .backends import create_backend, probe_all
from .config import RunConfig, load_config
from .errors import BackendUnavailable, ConfigError, DataError, ModelNotFound, MudpuppyError
from .training import run

__version__ = "0.1.0"

__all__ = [
    "create_backend", "probe_all", "RunConfig", "load_config", "run",
    "MudpuppyError", "ConfigError", "DataError", "BackendUnavailable", "ModelNotFound",
]
