"""mudpuppy: fine-tune language models on ROCm, CUDA, CPU and MLX from one YAML file.

    from mudpuppy import load_config, create_backend, run
    cfg = load_config("configs/quickstart.yaml", overrides=["training.max_steps=5"])
    result = run(cfg, create_backend("cpu"))

`run(cfg, backend, callbacks=[...])` hands the training loop your own observers (subclasses of
mudpuppy.monitor.callbacks.Callback), which hear every step, held-out check and checkpoint.
"""

from .backends import create_backend, probe_all
from .config import RunConfig
from .configure import load_config
from .errors import BackendUnavailable, ConfigError, DataError, ModelNotFound, MudpuppyError
from .training import run
from .training.curriculum import load_curriculum, run_curriculum

__version__ = "0.1.0"

__all__ = [
    "create_backend", "probe_all", "RunConfig", "load_config", "run", "load_curriculum", "run_curriculum",
    "MudpuppyError", "ConfigError", "DataError", "BackendUnavailable", "ModelNotFound",
]
