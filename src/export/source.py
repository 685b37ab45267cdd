"""What `mudpuppy export SOURCE` exports, found before any weights load.

SOURCE is what `mudpuppy eval` takes as a target (evaluation/targets.py finds it the same way):

    run directory      config.yaml beside the adapter (LoRA, DoRA, QLoRA) or the whole model: the
                       run's base, its tokenizer and the chat template it trained with
    adapter directory  adapter_config.json, on the exact base mudpuppy recorded beside it
                       (mudpuppy_base.json), else the one its config names (or --base-model)
    model directory    config.json: a merged, fully fine-tuned or plain causal LM
    model alias        smollm2-135m-instruct, a .gguf file, or a Hugging Face Hub id

Each source also carries the record of its base model (`base`, backends.provenance.base_record): from a run's
run_summary.json, an adapter's mudpuppy_base.json, an earlier export's export.json, or the name given. The
model card and the GGUF's metadata name the base by it, with where its weights truly came from.

A base or model directory whose config.json declares a `quantization_config` (a GPTQ output or a
converted QAT model) is first dequantized into plain float32 weights by the dequantizer registered for
its `quant_method` (DEQUANTIZERS); an adapter then merges into those weights, exactly as it
trained on them. Merging goes through the backend protocol (`merge_and_save`), so a QLoRA
adapter merges into the dequantized base it learned on, never into 4-bit weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..backends.adapters import read_base_record
from ..backends.models import MODEL_ALIASES, looks_like_local_path, patch_rope_theta, resolve_model
from ..backends.provenance import base_record
from ..configure import load_config
from ..errors import MudpuppyError
from ..evaluation.targets import (ADAPTER_CONFIG, MODEL_CONFIG, RUN_CONFIG, Column, adapter_column, model_column,
                                  read_json_object, run_column, with_trust)
from ..files import read_json
from .gptq import dequantize_gptq_dir
from .qat import dequantize_qat_dir

# quant_method -> writes a plain float32 model directory (config.json without quantization_config,
# *.safetensors, the tokenizer files) from a quantized one: fn(source_dir, target_dir).
Dequantizer = Callable[[Path, Path], None]
DEQUANTIZERS: dict[str, Dequantizer] = {"gptq": dequantize_gptq_dir, "mudpuppy_qat": dequantize_qat_dir}


def register_dequantizer(quant_method: str, fn: Dequantizer) -> None:
    """Teach export to read checkpoints of another `quant_method`."""
    DEQUANTIZERS[quant_method] = fn


class SourceError(MudpuppyError):
    """A SOURCE that is not a run, adapter or model, or one export cannot write."""


WHAT_A_SOURCE_IS = (f"SOURCE is a run directory (holding {RUN_CONFIG}), an adapter directory ({ADAPTER_CONFIG}), "
                    f"a model directory ({MODEL_CONFIG}), a .gguf file, a model alias "
                    f"({', '.join(MODEL_ALIASES)}) or a Hugging Face Hub id")


@dataclass
class ExportSource:
    given: str
    kind: str                      # run | adapter | model
    column: Column                 # what to load, and how (evaluation.targets)
    name: str                      # a short name for the files' metadata
    base: dict | None = None       # the base model's record (backends.provenance.base_record)
    finetune: str | None = None    # a fine-tune's name (the run's or adapter's directory); None for a plain model

    @property
    def cfg(self):
        return self.column.cfg

    @property
    def has_adapter(self) -> bool:
        return self.column.has_adapter

    def describe(self) -> str:
        return self.column.describe()

    def model_dir(self) -> Path:
        """The local directory of the weights to load (the base, for an adapter)."""
        m = self.cfg.model
        return resolve_model(m.base_model, m.revision, m.trust_remote_code).path

    def tokenizer_source(self) -> str:
        return self.cfg.model.tokenizer or str(self.model_dir())

    def load_tokenizer(self):
        """The tokenizer the model trained with, its chat template installed (a run's own choice)."""
        from transformers import AutoTokenizer

        from ..data.templates import apply_chat_template_choice

        tok = AutoTokenizer.from_pretrained(self.tokenizer_source(),
                                            trust_remote_code=self.cfg.model.trust_remote_code)
        apply_chat_template_choice(tok, self.cfg.data.chat_template)
        return tok

    def model_config(self) -> dict:
        return read_json_object(self.model_dir() / MODEL_CONFIG)

    def dequantize_into(self, staging: Path, echo) -> None:
        """A quantized base or model is replaced, for this export, by its dequantized copy in `staging`."""
        path = self.model_dir()
        quant = self.model_config().get("quantization_config")
        if not quant:
            return
        method = quant.get("quant_method", "?")
        fn = DEQUANTIZERS.get(method)
        if fn is None:
            raise SourceError(f"{path}: its config.json declares quantization_config.quant_method {method!r}, which "
                              f"export cannot dequantize; readable: {', '.join(sorted(DEQUANTIZERS))}")
        target = staging / "dequantized"
        echo(f"dequantizing the {method} weights of {path} to float32")
        if quant.get("activations") not in (None, "none"):
            echo(f"  note: its {quant['activations']} activation quantization is not part of the weights; "
                 "the export computes activations in float")
        fn(path, target)
        model = self.cfg.model.model_copy(update={"base_model": str(target)})
        if self.cfg.model.tokenizer is None:
            model = model.model_copy(update={"tokenizer": str(path)})
        self.column = replace(self.column, cfg=self.cfg.model_copy(update={"model": model}))

    def plain_dir(self) -> Path | None:
        """The model directory itself when it can be written without loading it (no adapter to merge,
        not quantized), else None."""
        if self.has_adapter or self.model_config().get("quantization_config"):
            return None
        return self.model_dir()

    def rebuilt_on(self, default: str) -> str:
        """The backend that rebuilds this source's base: an MLX run's QLoRA base is MLX's own 4-bit code (and
        after adapter.loftq_iter > 1, what MLX's iterations made of it), which torch's quantizer does not
        reproduce, so it is rebuilt on MLX; anything else on `default`."""
        mlx_qlora = self.kind == "run" and self.cfg.backend == "mlx" and self.cfg.adapter.type == "qlora"
        return "mlx" if mlx_qlora and self.has_adapter else default

    def merge_into(self, backend, path: Path, dtype: str) -> Path:
        """The model with its adapter folded in, saved as plain safetensors at `dtype` (float32,
        bfloat16, float16) with the training tokenizer and chat template."""
        self.merge_loaded(backend, path, dtype)
        return path

    def merge_loaded(self, backend, path: Path, dtype: str):
        """merge_into, returning the backend's handle on the merged model (at `dtype`), for work on the
        model that would otherwise load it again from `path`."""
        from ..data.templates import apply_chat_template_choice

        handle = self.column.load(backend, "fp32")
        apply_chat_template_choice(handle.tokenizer, self.cfg.data.chat_template)
        backend.merge_and_save(handle, str(path), dtype)
        patch_config_for_runtimes(path)
        return handle


def patch_config_for_runtimes(model_dir: Path) -> None:
    """rope_theta at the top level of config.json too (transformers 5 nests it; mlx-lm reads it there)."""
    path = Path(model_dir) / MODEL_CONFIG
    config = read_json_object(path)
    patched = patch_rope_theta(config)
    if patched != config:
        path.write_text(json.dumps(patched, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def resolve_source(source: str, base_model: str | None = None, chat_template: str | None = None,
                   trust_remote_code: bool = False) -> ExportSource:
    """SOURCE found and checked; model code runs only with `trust_remote_code` (--trust-remote-code), never
    because a run directory's config.yaml asks for it (evaluation.targets.with_trust)."""
    found = find_source(source, base_model, chat_template)
    return replace(found, column=with_trust(found.column, source, trust_remote_code))


def find_source(source: str, base_model: str | None, chat_template: str | None) -> ExportSource:
    path = Path(source).expanduser()
    name = path.name if path.exists() else source
    name = name.removesuffix(".gguf") or source
    if path.is_dir():
        name = path.absolute().name or name          # "." names the directory it is
        if (path / RUN_CONFIG).is_file():
            cfg = load_config(path / RUN_CONFIG, check_files=False)
            if cfg.method in ("rm", "prm"):
                raise SourceError(f"{source}: a reward model run (method {cfg.method}) scores sequences; export writes "
                                  "causal language models")
            return ExportSource(source, "run", run_column(source, path), name, run_base(path, cfg), name)
        if (path / ADAPTER_CONFIG).is_file():
            column = adapter_column(source, path, base_model, chat_template)
            record = None if base_model else read_base_record(path)
            return ExportSource(source, "adapter", column, name, record or base_record(column.base_name), name)
        if (path / MODEL_CONFIG).is_file():
            base, finetune = exported_base(path)
            return ExportSource(source, "model", model_column(source, str(path), chat_template), name,
                                base or base_record(source), finetune)
        raise SourceError(f"{source}: a directory, but not a run, an adapter or a model; {WHAT_A_SOURCE_IS}")
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise SourceError(f"{source}: a file, not a model; {WHAT_A_SOURCE_IS}")
    # A path that is not there (its parent is, or it is spelled as a path), rather than a Hub id.
    if not path.exists() and (looks_like_local_path(source) or path.parent.name and path.parent.is_dir()):
        raise SourceError(f"{source}: no such file or directory ({path.resolve()}); {WHAT_A_SOURCE_IS}")
    # An alias, a .gguf file or a Hub id: resolved (converted once, cached) when the model is first needed.
    return ExportSource(source, "model", model_column(source, source, chat_template), name, base_record(source))


def run_base(path: Path, cfg) -> dict:
    """A run's base as the run recorded it (run_summary.json), else as its config names it."""
    summary = path / "run_summary.json"
    if summary.is_file():
        data = read_json(summary)
        if isinstance(data, dict) and isinstance(data.get("base"), dict):
            return data["base"]
    return base_record(cfg.model.base_model, cfg.model.revision)


def exported_base(path: Path) -> tuple[dict | None, str | None]:
    """(base record, fine-tune name) that an earlier `mudpuppy export` of a model directory recorded in its
    export.json (a merged run exported again as GGUF keeps naming its base); (None, None) otherwise."""
    marker = path / "export.json"
    if not marker.is_file():
        return None, None
    data = read_json(marker)
    if not isinstance(data, dict) or not isinstance(data.get("base"), dict):
        return None, None
    return data["base"], data.get("finetune")
