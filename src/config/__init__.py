"""The schema of a run: one YAML file in, a validated `RunConfig` out.

Everything is checked before anything heavy loads. Problems are collected and
raised together as one `ConfigError`, each named by its dotted config path
(``training.learning_rate``, ``data.datasets.0.path``), so a user fixes a
broken config in one pass rather than one error per run.

One module per section (model.py: model and adapter; data.py; training.py:
training, eval, memory, distributed, logging; methods.py: preference, reward,
grpo, gptq, qat; run.py: the RunConfig root), the YAML reading and overrides
apart (source.py), and the reporting of problems (issues.py). This package
imports nothing of mudpuppy's above it: the checks that need `data/` or
`rewards/` (chat template names, reward specs, a vision or mixture-of-experts
base's limits) belong to the check step, `mudpuppy.configure`, whose
`load_config` reads, validates and checks a config in one call.
"""

from ..errors import ConfigError
from .data import DATASET_TYPES, DataConfig, DatasetSpec
from .issues import Issue, _missing_files, _pydantic_issues
from .methods import GptqConfig, GrpoConfig, PreferenceConfig, QatConfig, RewardConfig, grpo_batch_problems
from .model import AdapterConfig, ModelConfig
from .run import BACKEND_NAMES, RunConfig, resolve_relative
from .source import MAX_YAML_VALUES, _read_yaml, apply_override, bounded_yaml_load, read_source
from .training import DistributedConfig, EvalConfig, LoggingConfig, MemoryConfig, TrainingConfig

__all__ = [
    "RunConfig", "ModelConfig", "AdapterConfig", "DatasetSpec", "DataConfig", "TrainingConfig", "EvalConfig",
    "MemoryConfig", "DistributedConfig", "LoggingConfig", "PreferenceConfig", "RewardConfig", "GrpoConfig",
    "GptqConfig", "QatConfig", "BACKEND_NAMES", "DATASET_TYPES", "ConfigError", "Issue",
    "grpo_batch_problems", "resolve_relative", "read_source", "apply_override", "bounded_yaml_load",
    "MAX_YAML_VALUES",
    # shared with training/curriculum.py, which checks each stage as a run
    "_read_yaml", "_pydantic_issues", "_missing_files",
]
