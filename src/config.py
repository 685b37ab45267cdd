"""The schema of a run: one YAML file in, a validated `RunConfig` out.

Everything is checked before anything heavy loads. Problems are collected and
raised together as one `ConfigError`, each named by its dotted config path
(``training.learning_rate``, ``data.datasets.0.path``), so a user fixes a
broken config in one pass rather than one error per run.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError

BACKEND_NAMES = ("auto", "cpu", "cuda", "rocm", "mlx")
DATASET_TYPES = (
    "auto", "chat", "text", "instruction", "completion",
    "preference", "kto", "reward", "rl", "prm",
)


class _Strict(BaseModel):
    """Base for every section: unknown keys are errors, assignments re-validate."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    base_model: str = Field(min_length=1, description="HF directory, hub id, .gguf file, or alias")
    tokenizer: str | None = Field(None, description="defaults to base_model")
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"


class AdapterConfig(_Strict):
    type: Literal["none", "lora", "dora"] = "lora"
    r: int = Field(8, gt=0, le=4096)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    rslora: bool = False

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("give at least one module name, or 'all-linear'")
        return v


class DatasetSpec(_Strict):
    path: str = Field(min_length=1, description="JSONL/JSON/CSV/Parquet file, or hub dataset name")
    type: Literal[DATASET_TYPES] = "auto"  # type: ignore[valid-type]
    split: str = "train"
    field_map: dict[str, str] = Field(default_factory=dict, description="source field -> our field")
    roles_to_train: list[Literal["system", "user", "assistant", "tool"]] = ["assistant"]
    num_samples: int | None = Field(None, gt=0)
    weight: float | None = Field(None, gt=0)


class DataConfig(_Strict):
    datasets: list[DatasetSpec] = Field(min_length=1)
    val_datasets: list[DatasetSpec] = Field(default_factory=list)
    val_set_size: float = Field(0.0, ge=0.0, description="fraction (<1) or count (>=1) held out")
    sequence_len: int = Field(2048, gt=8)
    truncation: Literal["truncate", "drop"] = "truncate"
    chat_template: str | None = Field(None, description="'tokenizer' (default), or a built-in name")
    packing: bool = False
    shuffle: bool = True
    skip_bad_records: bool = False

    @field_validator("val_set_size")
    @classmethod
    def _whole_counts(cls, v):
        if v >= 1 and v != int(v):
            raise ValueError("a count must be a whole number; a fraction must be below 1")
        return v


class TrainingConfig(_Strict):
    epochs: float | None = Field(None, gt=0)
    max_steps: int | None = Field(None, gt=0)
    micro_batch_size: int = Field(1, gt=0)
    gradient_accumulation_steps: int = Field(1, gt=0)
    learning_rate: float = Field(2e-4, gt=0)
    lr_scheduler: Literal["linear", "cosine", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    weight_decay: float = Field(0.0, ge=0.0)
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    gradient_checkpointing: bool = False
    seed: int = 42

    @model_validator(mode="after")
    def _one_length(self):
        if self.epochs is None and self.max_steps is None:
            self.epochs = 1.0
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("set warmup_steps or warmup_ratio, not both")
        return self


class EvalConfig(_Strict):
    """Held-out evaluation run before and after training (the quickstart table)."""

    before_training: bool = True
    after_training: bool = True
    loss: bool = True
    exact_match: bool = False
    max_samples: int | None = Field(None, gt=0)
    max_new_tokens: int = Field(32, gt=0)
    batch_size: int = Field(16, gt=0)


class LoggingConfig(_Strict):
    log_every: int = Field(1, gt=0)
    progress_bar: bool = True


class RunConfig(_Strict):
    model: ModelConfig
    backend: Literal[BACKEND_NAMES] = "auto"  # type: ignore[valid-type]
    method: Literal["sft"] = "sft"
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    data: DataConfig
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    output_dir: str = Field(min_length=1)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    # Where the YAML came from; relative data paths resolve against it first.
    source_dir: str | None = Field(None, exclude=True)

    def resolve_path(self, path: str) -> Path:
        """A data path as the user meant it: config directory first, then cwd."""
        return resolve_relative(path, self.source_dir)

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"source_dir"})


def resolve_relative(path: str, source_dir: str | None) -> Path:
    p = Path(os.path.expanduser(path))
    if p.is_absolute():
        return p
    if source_dir is not None:
        beside = Path(source_dir) / p
        if beside.exists() or not p.exists():
            return beside
    return p


# --------------------------------------------------------------------------- loading

@dataclass(frozen=True)
class Issue:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def load_config(
    source: str | os.PathLike | dict,
    overrides: list[str] | tuple[str, ...] = (),
    check_files: bool = True,
) -> RunConfig:
    """Read a YAML file (or a dict), apply ``key.sub=value`` overrides, validate.

    Raises `ConfigError` listing every problem found, each with its path.
    """
    if isinstance(source, dict):
        raw, origin, source_dir = copy.deepcopy(source), "<dict>", None
    else:
        origin = str(source)
        raw = _read_yaml(Path(source))
        source_dir = str(Path(source).resolve().parent)
    issues: list[Issue] = []
    for item in overrides:
        try:
            apply_override(raw, item)
        except ValueError as exc:
            issues.append(Issue(f"--set {item}", str(exc)))
    if issues:
        raise ConfigError(origin, [str(i) for i in issues])
    raw["source_dir"] = source_dir
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(origin, [str(i) for i in _pydantic_issues(exc)]) from None
    if check_files:
        issues.extend(_missing_files(cfg))
    if issues:
        raise ConfigError(origin, [str(i) for i in issues])
    return cfg


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(str(path), ["config file not found"])
    try:
        with path.open("r", encoding="utf-8") as fh:
            raw = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(str(path), [f"{where}not valid YAML ({getattr(exc, 'problem', exc)})"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), [f"not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None
    if raw is None:
        raise ConfigError(str(path), ["the file is empty"])
    if not isinstance(raw, dict):
        raise ConfigError(str(path), [f"expected a mapping of sections at the top, found {type(raw).__name__}"])
    return raw


def apply_override(raw: dict, item: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML.

    Numeric segments index lists (``data.datasets.0.path=x.jsonl``).
    """
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ValueError("expected KEY=VALUE, e.g. training.max_steps=5")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    parts = key.strip().split(".")
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        node = _step_into(node, part, ".".join(parts[: depth + 1]))
    last = parts[-1]
    if isinstance(node, list):
        idx = _index(node, last, key)
        node[idx] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ValueError(f"'{'.'.join(parts[:-1])}' is a value, not a section")


def _step_into(node: Any, part: str, where: str) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, where)]
    if not isinstance(node, dict):
        raise ValueError(f"'{where}' is inside a value, not a section")
    if node.get(part) is None:
        node[part] = {}
    return node[part]


def _index(node: list, part: str, where: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ValueError(f"'{where}': list index {part!r} out of range (list has {len(node)} items)")
    return int(part)


def _pydantic_issues(exc: ValidationError) -> list[Issue]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if p not in ("function-after",))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check its spelling and section; see docs/config.md)"
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif err["type"].startswith("literal_error"):
            msg = f"{msg}; got {err.get('input')!r}"
        elif "input" in err and not isinstance(err["input"], (dict, list)):
            msg = f"{msg}; got {err['input']!r}"
        msg = msg.removeprefix("Value error, ")
        out.append(Issue(loc, msg))
    return out


def _missing_files(cfg: RunConfig) -> list[Issue]:
    issues = []
    for section in ("datasets", "val_datasets"):
        for i, spec in enumerate(getattr(cfg.data, section)):
            if _looks_local(spec.path) and not cfg.resolve_path(spec.path).exists():
                tried = cfg.resolve_path(spec.path)
                issues.append(Issue(f"data.{section}.{i}.path", f"file not found: {spec.path} (looked at {tried})"))
    return issues


def _looks_local(path: str) -> bool:
    """Hub dataset names look like 'org/name'; files have an extension or a path."""
    suffixes = (".jsonl", ".json", ".csv", ".parquet", ".txt", ".arrow")
    return path.endswith(suffixes) or path.startswith((".", "/", "~")) or os.sep + os.sep in path
