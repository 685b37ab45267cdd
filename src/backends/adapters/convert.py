"""An adapter directory in either format: which one it is, reading it, and converting it to the other."""

from __future__ import annotations

import json
from pathlib import Path

from ...output_dir import ADAPTER, writing
from .base_record import local_base_record, read_base_record, record_base
from .mlx_format import adapter_from_mlx, write_mlx
from .neutral import CONFIG_FILE, MLX_WEIGHTS, PEFT_WEIGHTS, Adapter
from .peft_format import adapter_from_peft, write_peft
from .tensors import AdapterError, read_safetensors


def detect_format(path: str | Path) -> str:
    """'peft' or 'mlx' for an adapter directory; a clear AdapterError for anything else."""
    root = Path(path)
    if not root.exists():
        raise AdapterError(f"{root}: no such directory")
    if not root.is_dir():
        raise AdapterError(f"{root} is a file; an adapter is a directory holding {CONFIG_FILE}")
    has_config = (root / CONFIG_FILE).is_file()
    if has_config and (root / PEFT_WEIGHTS).is_file():
        return "peft"
    if has_config and (root / MLX_WEIGHTS).is_file():
        return "mlx"
    if has_config and (root / "adapter_model.bin").is_file():
        raise AdapterError(f"{root} holds a pickled PEFT adapter (adapter_model.bin); re-save it with "
                           "save_pretrained(..., safe_serialization=True) to convert it")
    hint = " (it looks like a full model: config.json)" if (root / "config.json").is_file() else ""
    raise AdapterError(f"{root} is not an adapter directory: expected {CONFIG_FILE} with {PEFT_WEIGHTS} (PEFT) "
                       f"or {MLX_WEIGHTS} (mlx-lm){hint}")


def read_adapter(path: str | Path) -> Adapter:
    """Read a PEFT or mlx-lm adapter directory into the neutral form."""
    root = Path(path)
    fmt = detect_format(root)
    try:
        config = json.loads((root / CONFIG_FILE).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise AdapterError(f"{root / CONFIG_FILE}: not valid JSON ({exc})") from None
    if fmt == "peft":
        tensors, _ = read_safetensors(root / PEFT_WEIGHTS)
        return adapter_from_peft(config, tensors, root)
    tensors, _ = read_safetensors(root / MLX_WEIGHTS)
    return adapter_from_mlx(config, tensors, root)


def convert_adapter(src: str | Path, dst: str | Path, to: str) -> Path:
    """Convert the adapter in `src` to `to` ('peft' or 'mlx') in `dst`, which must be empty or new.

    mudpuppy's record of the exact base goes along; an adapter without one whose base is a local directory
    that names its Hub model (an older mudpuppy adapter, trained on the cache's conversion of an alias, or
    on a Hub snapshot) is given one, so the copy names that Hub model."""
    if to not in ("peft", "mlx"):
        raise AdapterError(f"unknown adapter format {to!r}; choose peft or mlx")
    adapter = read_adapter(src)
    out = Path(dst)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise AdapterError(f"{out} already exists and is not an empty directory; choose a new destination")
    # The output contract (mudpuppy.output_dir): written beside DST, renamed into place once complete, DST locked.
    with writing(out, ADAPTER, what="DST") as staged:
        written = write_peft(adapter, staged.dir) if to == "peft" else write_mlx(adapter, staged.dir)
        record = read_base_record(src) or local_base_record(adapter.base_model)
        if record is not None:
            record_base(written, record)
    return out
