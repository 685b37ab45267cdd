"""mudpuppy's record of the exact base an adapter was trained on (BASE_FILE, beside each adapter_config.json
it writes), and the portable base name in the adapter configs themselves."""

from __future__ import annotations

import json
from pathlib import Path

from ...files import write_json_atomic
from .neutral import BASE_FILE, CONFIG_FILE, MLX_SUBDIR, MUDPUPPY_KEY
from .tensors import AdapterError


def local_base_record(base_model: str | None) -> dict | None:
    """The record of a base named by a local directory that knows its Hub id; None otherwise."""
    from ..provenance import base_record_of_path, hub_id_of_dir

    if not base_model or not Path(base_model).expanduser().is_dir() or hub_id_of_dir(base_model)[0] is None:
        return None
    return base_record_of_path(base_model)


def record_base(directory: str | Path, record: dict) -> None:
    """Name the base portably in the adapter configs of `directory` (PEFT's, and mlx-lm's copy in mlx/):
    `record["base_model_name_or_path"]`, a Hub id where one is known; and keep mudpuppy's whole record
    beside each (BASE_FILE), which is what mudpuppy loads the base from again."""
    root = Path(directory)
    name = record["base_model_name_or_path"]
    for where in (root, root / MLX_SUBDIR):
        path = where / CONFIG_FILE
        if not path.is_file():
            continue
        config = json.loads(path.read_text(encoding="utf-8"))
        if "peft_type" in config:
            rename_in_card(where / "README.md", config.get("base_model_name_or_path"), name)
            config["base_model_name_or_path"] = name
        else:                                   # mlx-lm's: its "model", and the PEFT config it carries
            config["model"] = name
            peft = (config.get(MUDPUPPY_KEY) or {}).get("peft_config")
            if isinstance(peft, dict):
                peft["base_model_name_or_path"] = name
        write_json_atomic(path, config)
        write_json_atomic(where / BASE_FILE, record)


def rename_in_card(card: Path, old: str | None, new: str) -> None:
    """The minimal card PEFT's save_pretrained writes names the base (front matter `base_model`, the tag
    `base_model:adapter:...`) as its config did: rename it there too, and only there."""
    if not old or old == new or not card.is_file():
        return
    text = card.read_text(encoding="utf-8")
    if not text.startswith("---\n") or "\n---" not in text[4:]:
        return
    end = text.index("\n---", 4)
    front = "\n".join(line.replace(old, new) if line.lstrip("- ").startswith(("base_model:", "base_model ")) else line
                      for line in text[:end].split("\n"))
    card.write_text(front + text[end:], encoding="utf-8")


def read_base_record(directory: str | Path) -> dict | None:
    """mudpuppy's record of the base an adapter directory was trained on (BASE_FILE), or None (an adapter
    from elsewhere, or from before mudpuppy kept one)."""
    from ...files import read_json

    path = Path(directory) / BASE_FILE
    if not path.is_file():
        return None
    record = read_json(path)
    if not isinstance(record, dict) or not record.get("given"):
        raise AdapterError(f"{path}: expected mudpuppy's record of the base model (an object with \"given\")")
    return record
