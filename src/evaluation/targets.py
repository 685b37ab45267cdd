"""What `mudpuppy eval` can measure, found from a path before any model loads.

A target is one of:

    run directory      config.yaml beside the adapter (adapter_config.json) or the whole model
                       (config.json): the run's base, tokenizer, chat template and data settings
    adapter directory  adapter_config.json (PEFT, or mlx-lm's adapters.safetensors): on the exact base
                       mudpuppy recorded beside it (mudpuppy_base.json: the alias, path or Hub commit it
                       trained on), else the one its adapter_config.json names (base_model_name_or_path),
                       or --base-model
    model directory    config.json: a merged or plain causal LM, loaded as it is
    model alias        smollm2-135m-instruct, or a .gguf file (see backends/models.py)

Each becomes a `Column` of the comparison: what to load, how (a QLoRA run's base is
quantized as in training), and the run config whose template and masks tokenize the data.
`Column.base()` is the same model with the adapter off, for --base.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from ..backends.adapters import CONFIG_FILE as ADAPTER_CONFIG
from ..backends.adapters import convert_adapter, detect_format, read_adapter, read_base_record
from ..backends.models import MODEL_ALIASES
from ..backends.provenance import base_to_load
from ..config import RunConfig
from ..configure import load_config
from ..errors import MudpuppyError
from ..files import check_directory, check_model_files, read_json

RUN_CONFIG = "config.yaml"
MODEL_CONFIG = "config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SCORE_HEADS = ("ForSequenceClassification", "ForTokenClassification")


class TargetError(MudpuppyError):
    """A TARGET that is not a run, an adapter or a model, or one that cannot be evaluated."""


@dataclass
class Column:
    """One model of the comparison."""

    name: str                      # the table's column header
    target: str                    # what the user gave (for a base column: the target it came from)
    kind: str                      # run | adapter | model | base
    cfg: RunConfig                 # model to load, and the data settings (template, masks, sequence_len)
    adapter_dir: Path | None = None
    base_name: str | None = None   # the base model, as named in the config or adapter

    @property
    def has_adapter(self) -> bool:
        return self.adapter_dir is not None

    def describe(self) -> str:
        if self.kind == "base":
            return f"base model {self.base_name}, no adapter"
        if self.has_adapter:
            return f"{self.kind}: {self.cfg.adapter.type} adapter on {self.base_name}"
        if self.kind == "run" and self.cfg.method == "qat":
            return f"run: QAT int{self.cfg.qat.weight_bits} model (converted) of {self.base_name}"
        if self.kind == "run" and self.cfg.method == "gptq":
            return f"run: GPTQ {self.cfg.gptq.bits}-bit model of {self.base_name}"
        if self.kind == "run":
            return f"run: full fine-tune of {self.base_name}"
        return f"model {self.cfg.model.base_model}"

    def load(self, backend, precision: str):
        """The model as trained: a QLoRA adapter's base is quantized the way training quantized it
        (deterministic), any other base is loaded at `precision`; then the adapter, if any."""
        local = Path(self.cfg.model.base_model).expanduser()
        if self.kind == "model" and (local / MODEL_CONFIG).is_file():
            check_model_files(local)         # weights and a tokenizer there: a half-written folder named now
        qlora = self.cfg.adapter.type == "qlora" and (self.has_adapter or self.kind == "base")
        handle = backend.load_model(self.cfg.model, precision, adapter=self.cfg.adapter if qlora else None)
        if qlora:
            backend.quantize_base(handle, self.cfg.adapter)
        if self.has_adapter:
            load_trained_adapter(backend, handle, self.cfg.adapter, self.adapter_dir)
        return handle

    def base(self) -> Column | None:
        """The base model with no adapter (a full fine-tune's starting weights), or None for a plain model."""
        if self.kind in ("model", "base") or self.base_name is None:
            return None
        model = self.cfg.model.model_copy(update={"base_model": self.base_name})
        return replace(self, name="base", kind="base", cfg=self.cfg.model_copy(update={"model": model}),
                       adapter_dir=None)

    def base_key(self) -> tuple:
        """Columns whose bases are the same model, loaded and templated the same way, share one base
        column (measured with the first one's tokenizer and data settings)."""
        quant = self.cfg.adapter.model_dump() if self.cfg.adapter.type == "qlora" else None
        return self.base_name, self.cfg.data.chat_template, json.dumps(quant, sort_keys=True)


def loftq_changed_base(adapter_cfg) -> bool:
    """True when training changed the base under the adapter: LoftQ's iterations (adapter.loftq_iter > 1)
    requantize each target, so the adapter belongs on that base, not on the checkpoint's weights."""
    return adapter_cfg.type == "qlora" and adapter_cfg.init == "loftq" and adapter_cfg.loftq_iter > 1


def load_trained_adapter(backend, handle, adapter_cfg, path: Path) -> None:
    """The adapter a run with `adapter_cfg` saved at `path`, on `handle` (its base loaded as training
    loaded it). After adapter.loftq_iter > 1 that base is not the checkpoint quantized again: LoftQ's
    iterations changed it, so they run again (as on resume) under the saved A, B (init_from)."""
    if loftq_changed_base(adapter_cfg):
        backend.attach_adapter(handle, adapter_cfg.model_copy(update={"init_from": str(path)}))
        return
    load_adapter_any_layout(backend, handle, path)


def load_adapter_any_layout(backend, handle, path: Path) -> None:
    """An adapter in a layout the backend reads loads as it is (MLX reads both); otherwise a converted copy
    in PEFT's layout, which every backend reads."""
    if detect_format(path) in backend.adapter_layouts:
        backend.load_adapter(handle, str(path))
        return
    with tempfile.TemporaryDirectory(prefix="mudpuppy-eval-adapter-") as tmp:
        backend.load_adapter(handle, str(convert_adapter(path, Path(tmp) / "peft", "peft")))


# --------------------------------------------------------------------------- finding targets

def resolve_targets(targets: list[str], base_model: str | None = None,
                    chat_template: str | None = None, trust_remote_code: bool = False) -> list[Column]:
    columns = [resolve_target(t, base_model, chat_template, trust_remote_code) for t in targets]
    return name_columns(columns)


def resolve_target(target: str, base_model: str | None, chat_template: str | None,
                   trust_remote_code: bool = False) -> Column:
    """The column for TARGET. Model code from a repository or directory runs only when the command that
    reads it says so (`trust_remote_code`, from --trust-remote-code): a run directory is only read, so the
    `model.trust_remote_code` its config.yaml carries is never honoured by itself (a shared run directory
    with an `auto_map` in its config.json would otherwise run its Python unasked)."""
    return with_trust(find_target(target, base_model, chat_template), target, trust_remote_code)


def with_trust(column: Column, target: str, trust_remote_code: bool) -> Column:
    """The column with model.trust_remote_code set by the command, not by anything read from disk."""
    if column.cfg.model.trust_remote_code and not trust_remote_code:
        raise TargetError(f"{target}: its {RUN_CONFIG} sets model.trust_remote_code: true, so loading it may run Python "
                          "files that came with the model; mudpuppy runs such code only when the command asks for "
                          "it: pass --trust-remote-code if you trust where this run and its base model came from")
    local = column.cfg.model.base_model
    if not trust_remote_code and declares_code(Path(local).expanduser()):
        raise TargetError(f"{target}: {Path(local) / MODEL_CONFIG} declares auto_map (model code shipped as Python "
                          "files beside the weights); mudpuppy runs such code only when asked: pass "
                          "--trust-remote-code if you trust where it came from")
    model = column.cfg.model.model_copy(update={"trust_remote_code": trust_remote_code})
    return replace(column, cfg=column.cfg.model_copy(update={"model": model}))


def declares_code(model_dir: Path) -> bool:
    """True when a local model directory's config.json asks for code of its own (auto_map)."""
    config = model_dir / MODEL_CONFIG
    if not config.is_file():
        return False
    return bool(read_json_object(config).get("auto_map"))


def read_json_object(path: Path) -> dict:
    """A JSON object from `path`, or one message naming the file when it is not one (half-written, binary)."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise TargetError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def find_target(target: str, base_model: str | None, chat_template: str | None) -> Column:
    path = Path(target).expanduser()
    if path.is_dir():
        if (path / RUN_CONFIG).is_file():
            return run_column(target, path)
        if (path / ADAPTER_CONFIG).is_file():
            return adapter_column(target, path, base_model, chat_template)
        if (path / MODEL_CONFIG).is_file():
            return model_column(target, str(path), chat_template)
        raise TargetError(f"{target}: a directory, but not a run ({RUN_CONFIG}), an adapter ({ADAPTER_CONFIG}) "
                          f"or a model ({MODEL_CONFIG}); {WHAT_A_TARGET_IS}")
    if target.lower() in MODEL_ALIASES or (path.is_file() and path.suffix.lower() == ".gguf"):
        return model_column(target, target, chat_template)
    what = "a file, not a directory" if path.exists() else f"no such file or directory ({path.resolve()})"
    raise TargetError(f"{target}: {what}; {WHAT_A_TARGET_IS}")


WHAT_A_TARGET_IS = (f"a target is a run directory (holding {RUN_CONFIG}), an adapter directory ({ADAPTER_CONFIG}), "
                    f"a model directory ({MODEL_CONFIG}), a .gguf file or a model alias ({', '.join(MODEL_ALIASES)})")


def run_column(target: str, path: Path) -> Column:
    check_directory(path)       # a damaged adapter, config.json or tokenizer.json named now, not deep in a loader
    cfg = load_config(path / RUN_CONFIG, check_files=False)
    if cfg.method in ("rm", "prm"):
        raise TargetError(f"{target}: a reward model run (method {cfg.method}) scores sequences and generates "
                          f"nothing to evaluate here; use `mudpuppy score {path / RUN_CONFIG} --data FILE`")
    tokenizer = cfg.model.tokenizer or own_tokenizer(path)
    if (path / ADAPTER_CONFIG).is_file() and cfg.adapter.type != "none":
        model = cfg.model.model_copy(update={"tokenizer": tokenizer})
        return Column("", target, "run", cfg.model_copy(update={"model": model}), path, cfg.model.base_model)
    if (path / MODEL_CONFIG).is_file():
        model = cfg.model.model_copy(update={"base_model": str(path), "tokenizer": tokenizer})
        return Column("", target, "run", cfg.model_copy(update={"model": model}), None, cfg.model.base_model)
    raise TargetError(f"{target}: a run directory, but it holds no trained adapter ({ADAPTER_CONFIG}) or model "
                      f"({MODEL_CONFIG}) yet; a run saves them when it finishes (is run_summary.json there?)")


def adapter_column(target: str, path: Path, base_model: str | None, chat_template: str | None) -> Column:
    check_directory(path)
    named, revision = (base_model, None) if base_model else adapter_base(path)
    if not named:
        raise TargetError(f"{target}: the adapter does not name its base model ({ADAPTER_CONFIG} has no "
                          "base_model_name_or_path); pass --base-model")
    if not base_model and named.startswith(("/", "./", "../", "~")) and not Path(named).expanduser().exists():
        raise TargetError(f"{target}: its base model {named} ({ADAPTER_CONFIG}, base_model_name_or_path) does not "
                          "exist on this machine; pass --base-model with a path or alias of the same model")
    kind = read_adapter_kind(path)
    cfg = synthetic_config(named, own_tokenizer(path), chat_template, adapter_type=kind, revision=revision)
    return Column("", target, "adapter", cfg, path, named)


def model_column(target: str, model: str, chat_template: str | None) -> Column:
    config = Path(model) / MODEL_CONFIG
    if config.is_file():
        heads = [a for a in read_json_object(config).get("architectures") or []
                 if a.endswith(SCORE_HEADS)]
        if heads:
            raise TargetError(f"{target}: a {heads[0]} model scores sequences and generates nothing to evaluate "
                              "here; use `mudpuppy score` for reward models")
    return Column("", target, "model", synthetic_config(model, None, chat_template))


def adapter_base(path: Path) -> tuple[str | None, str | None]:
    """(base model, revision) to load an adapter directory on: the exact base mudpuppy recorded when it saved
    the adapter (an alias stays the alias, offline, though adapter_config.json names its Hub model), else
    what adapter_config.json names."""
    record = read_base_record(path)
    if record is not None:
        return base_to_load(record)
    return read_adapter_base(path), None


def read_adapter_base(path: Path) -> str | None:
    """The base as the adapter's own config names it (PEFT's base_model_name_or_path, mlx-lm's model)."""
    if detect_format(path) == "peft":
        return read_json_object(path / ADAPTER_CONFIG).get("base_model_name_or_path")
    return read_adapter(path).base_model


def read_adapter_kind(path: Path) -> str:
    if detect_format(path) == "peft":
        return "dora" if read_json_object(path / ADAPTER_CONFIG).get("use_dora") else "lora"
    return read_adapter(path).kind


def own_tokenizer(path: Path) -> str | None:
    """A run or adapter saves the tokenizer it trained with (its chat template included): use that one."""
    return str(path) if (path / TOKENIZER_CONFIG).is_file() else None


def synthetic_config(model: str, tokenizer: str | None, chat_template: str | None,
                     adapter_type: str = "none", revision: str | None = None) -> RunConfig:
    """Defaults for a target that has no run config: the tokenizer's template, the default masks."""
    return load_config({"model": {"base_model": model, "tokenizer": tokenizer, "revision": revision},
                        "adapter": {"type": adapter_type},
                        "data": {"datasets": [{"path": "unused.jsonl"}], "chat_template": chat_template},
                        "output_dir": "unused"}, check_files=False)


# --------------------------------------------------------------------------- columns

def with_bases(columns: list[Column]) -> list[Column]:
    """The columns, then one base column per distinct base (adapter off)."""
    bases: dict[tuple, Column] = {}
    for col in columns:
        base = col.base()
        if base is not None:
            bases.setdefault(col.base_key(), base)
    if not bases:
        raise TargetError("--base: none of the targets has a base model to compare with (they are plain or "
                          "merged models); evaluate the base model as a target of its own instead")
    if len(bases) > 1:
        bases = {k: replace(b, name=f"base ({Path(b.base_name).name})") for k, b in bases.items()}
    return name_columns(columns + list(bases.values()))


def name_columns(columns: list[Column]) -> list[Column]:
    """Headers: a target's directory name, or the path as given where two names would clash."""
    for col in columns:
        if not col.name:
            col.name = Path(col.target).expanduser().resolve().name or col.target
    names = [c.name for c in columns]
    for col in columns:
        if names.count(col.name) > 1 and col.kind != "base":
            col.name = col.target
    seen: dict[str, int] = {}
    for col in columns:
        seen[col.name] = seen.get(col.name, 0) + 1
        if seen[col.name] > 1:
            col.name = f"{col.name} #{seen[col.name]}"
    return columns
