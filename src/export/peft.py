"""`mudpuppy export --format peft`: a run's adapter for PEFT and mlx-lm elsewhere, with the base it belongs on.

Most adapters learned on the checkpoint's own weights (a QLoRA's 4-bit base is that checkpoint quantized
again): the export is the adapter in PEFT's layout (and mlx-lm's, in mlx/), its base named as the run
named it, and the training tokenizer.

adapter.init loftq with loftq_iter > 1 (PEFT's `loftq_init`) is the exception: each iteration quantized
W - L R again, so the 4-bit base the adapter trained against is no longer the checkpoint quantized, and
the adapter alone, in PEFT or mlx-lm, lands on the checkpoint's weights: another model, silently. As
PEFT's own LoftQ example does (examples/loftq_finetuning/quantize_save_load.py: the base saved beside the
adapter, `base_model_name_or_path` set to it), the export writes that base, dequantized, as a plain model
directory `base/` and points both adapter configs at it. The base is rebuilt exactly as `mudpuppy merge`
rebuilds it (evaluation.targets.load_trained_adapter) under a copy of the adapter whose B is zero, so
scale * B @ A adds nothing and the merge writes the base alone.

Everything else that hands the adapter alone to another tool (`mudpuppy convert-adapter` of the run, its
mlx/ copy or a checkpoint) is refused for such a run, naming this export and --format merged instead.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..backends.adapters import (MLX_SUBDIR, RawTensor, read_adapter, read_base_record, record_base, write_mlx,
                                 write_peft)
from ..configure import load_config
from ..data.tokenizers import save_tokenizer
from ..errors import MudpuppyError
from ..evaluation.targets import RUN_CONFIG, loftq_changed_base

BASE_DIR = "base"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CHECKPOINTS = "checkpoints"         # training.checkpoints.DIRNAME: run/checkpoints/step-N holds an adapter too


def check_source(src) -> None:
    """Before any weights load: --format peft needs an adapter to write."""
    if not src.has_adapter:
        raise MudpuppyError(f"--format peft writes an adapter, and {src.given} is a {src.describe()} with none; "
                            "use --format merged for a model")
    if src.kind == "adapter":           # a run's checkpoint or mlx/ copy carries no config of its own
        refuse_adapter_alone(src.given, "export --format peft")


def write_peft_export(src, tokenizer, dtype: str | None, staging: Path, final: Path, work: Path,
                      backend_name: str, echo) -> dict:
    """The adapter (PEFT's layout at the top, mlx-lm's in mlx/), the tokenizer, and for a LoftQ-iterated run
    the base it trained on in base/; returns export.json's "peft" entry. `final` is where the export will
    stand once published: the adapter configs name base/ there."""
    from ..backends import create_backend

    adapter = read_adapter(src.column.adapter_dir)
    adapter_cfg = src.cfg.adapter
    if not loftq_changed_base(adapter_cfg):
        if dtype is not None:
            raise MudpuppyError(f"--dtype: a {adapter_cfg.type} adapter's base is the checkpoint's own weights, so "
                                "--format peft writes no base to set a precision for; leave --dtype out")
        echo("writing the adapter in PEFT's and mlx-lm's layouts")
        write_adapter(adapter, staging)
        record = read_base_record(src.column.adapter_dir) or src.base
        if record and record.get("base_model_name_or_path"):
            record_base(staging, record)
        save_tokenizer(tokenizer, staging)
        return {"base": None, "base_model_name_or_path": adapter.base_model if not record
                else record["base_model_name_or_path"]}
    dtype = dtype or checkpoint_dtype(src)
    name = src.rebuilt_on(backend_name)
    check_room(src, dtype, staging)
    echo(f"writing the 4-bit base LoftQ's {adapter_cfg.loftq_iter} iterations left, dequantized to {dtype}, "
         f"in {BASE_DIR}/ (the adapter trained on it, not on the checkpoint's weights)")
    zeroed = write_peft(without_update(adapter), work / "zero-update")
    base_only = replace(src, column=replace(src.column, adapter_dir=zeroed))
    base_only.merge_into(create_backend(name), staging / BASE_DIR, dtype)
    where = str(final / BASE_DIR)
    adapter.base_model = where
    if adapter.peft_config is not None:
        adapter.peft_config = {**adapter.peft_config, "base_model_name_or_path": where, "revision": None}
    echo("writing the adapter in PEFT's and mlx-lm's layouts, its base_model_name_or_path base/")
    write_adapter(adapter, staging)
    record_base(staging, exported_base_record(where, src, adapter_cfg.loftq_iter))
    save_tokenizer(tokenizer, staging)
    return {"base": BASE_DIR, "base_model_name_or_path": where, "dtype": dtype,
            "loftq_iter": adapter_cfg.loftq_iter, "rebuilt_by": name}


def write_adapter(adapter, staging: Path) -> None:
    write_peft(adapter, staging)
    write_mlx(adapter, staging / MLX_SUBDIR)


def without_update(adapter):
    """A copy of `adapter` with every B zero: attached, it leaves its base's output as it was."""
    def zero(t: RawTensor) -> RawTensor:
        return RawTensor(t.dtype, np.zeros_like(t.array))

    modules = {p: replace(m, lora_b=zero(m.lora_b)) for p, m in adapter.modules.items()}
    experts = {p: replace(e, lora_b=zero(e.lora_b)) for p, e in adapter.experts.items()}
    return replace(adapter, modules=modules, experts=experts)


def checkpoint_dtype(src) -> str:
    """The dtype the checkpoint's config.json states (transformers 5 `dtype`, 4.x `torch_dtype`); float32 where
    it states none a base can be written in."""
    config = src.model_config()
    stated = config.get("dtype") or config.get("torch_dtype")
    return stated if stated in DTYPE_BYTES else "float32"


def check_room(src, dtype: str, staging: Path) -> None:
    """The base is a whole model: refused before it is built when the disk holding --out has no room for it
    (its size estimated from the checkpoint's weight files at `dtype`)."""
    model_dir = src.model_dir()
    files = list(model_dir.glob("*.safetensors")) or list(model_dir.glob("*.bin"))
    size = sum(f.stat().st_size for f in files)
    need = size * DTYPE_BYTES[dtype] // DTYPE_BYTES[checkpoint_dtype(src)]
    free = shutil.disk_usage(staging).free
    if need > free:
        raise MudpuppyError(f"--format peft: the changed base is a whole model, about {need / 1e9:.2f} GB at {dtype}, "
                            f"and the disk holding {staging.parent} has {free / 1e9:.2f} GB free; free some space "
                            "or give --out on another disk (--format merged needs as much)")


def exported_base_record(where: str, src, iters: int) -> dict:
    """mudpuppy's record (BASE_FILE) of the base written in base/: a local directory, named by its path, so
    `mudpuppy eval` and `convert-adapter` of the export load and name that base, not the checkpoint."""
    original = (src.base or {}).get("base_model_name_or_path") or src.cfg.model.base_model
    return {"base_model_name_or_path": where, "given": where, "kind": "local", "hub_id": None, "revision": None,
            "commit": None, "hub_weights": False, "source": None, "local_path": where,
            "weights": f"the 4-bit base LoftQ's {iters} iterations (adapter.loftq_iter) made of {original}, "
                       "dequantized by mudpuppy export --format peft"}


def refuse_adapter_alone(path: str | Path, verb: str) -> None:
    """`verb` hands the adapter in `path` to another tool without its base: refused, with what to use instead,
    when `path` is the adapter of a run whose LoftQ iterations changed the base (the run directory, its mlx/
    copy, or one of its checkpoints)."""
    found = owning_run(Path(path).expanduser())
    if found is None:
        return
    run_dir, cfg = found
    if not loftq_changed_base(cfg.adapter):
        return
    raise MudpuppyError(
        f"{verb} {path}: the run {run_dir} set adapter.init loftq with loftq_iter {cfg.adapter.loftq_iter}, so its "
        "adapter trained against the 4-bit base LoftQ's iterations left, not the checkpoint's weights; the adapter "
        f"alone would load onto {cfg.model.base_model}'s own weights in PEFT or mlx-lm and compute another model. "
        f"Use `mudpuppy export {run_dir} --format peft` (the adapter with that base, dequantized, in {BASE_DIR}/) "
        f"or `mudpuppy export {run_dir} --format merged` (the adapter folded into it)")


def owning_run(path: Path):
    """(run directory, its config) when `path` is a run's adapter: the run itself, its mlx/ copy, or
    checkpoints/step-N; None otherwise (an adapter from elsewhere, or an export)."""
    candidates = [path]
    if path.name == MLX_SUBDIR:
        path = path.parent
        candidates.append(path)
    if path.parent.name == CHECKPOINTS:
        candidates.append(path.parent.parent)
    for run_dir in candidates:
        if (run_dir / RUN_CONFIG).is_file():
            return run_dir, load_config(run_dir / RUN_CONFIG, check_files=False)
    return None
