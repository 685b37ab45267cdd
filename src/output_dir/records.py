"""What each verb's output is made of, and the record that marks it as mudpuppy's.

Each kind of output has its record file, and it is the marker: `export.json` (export, merge), `eval.json`
(eval). Its `files` lists the names this output put in its folder, stamped with `"contract": 1` from the
entries of its own staging folder (staging.py), never by listing the target: a file the user or another
verb put there is never claimed. A folder written before the contract is adopted only for the names its
kind's layout defines (an export's `export.json` names its format: the files that format writes).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..files import write_json_atomic

CONTRACT = 1                             # a record stamped with it lists exactly what its output wrote

# --------------------------------------------------------------------------- what each verb writes
CARD_FILES = ("README.md", "export.json")
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
               "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
               "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
               "chat_template.json", "preprocessor_config.json", "processor_config.json")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapters.safetensors", "mudpuppy_base.json")
EXPORT_FILES = {"merged": MODEL_FILES + CARD_FILES, "mlx": MODEL_FILES + CARD_FILES,
                "gguf": ("model-*.gguf",) + CARD_FILES, "ollama": ("model-*.gguf", "Modelfile") + CARD_FILES}


def matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _adopt_export(folder: Path, record: dict) -> list[str]:
    """An export or merge written before the contract: the names its export.json lists that its format
    writes (a merge listed its folder after writing, so a file of yours could be among them)."""
    patterns = EXPORT_FILES.get(record.get("format"), sum(EXPORT_FILES.values(), ()))
    listed = record.get("files") if isinstance(record.get("files"), list) else None
    return [n for n in entries(folder) if matches(n, patterns) and (listed is None or n in listed)]


def _adopt_eval(folder: Path, record: dict) -> list[str]:
    """An evaluation written before the contract: eval.json, eval.md and the charts eval.json lists."""
    charts = [c for c in record.get("charts") or [] if isinstance(c, str) and matches(c, ("*.png",)) and "/" not in c]
    return [n for n in entries(folder) if n in ("eval.json", "eval.md", *charts)]


@dataclass(frozen=True)
class Kind:
    label: str                                        # for messages: "a mudpuppy export or merge"
    record: str | None = None                         # its record file: the marker of its folder
    adopt: Callable[[Path, dict], list[str]] | None = None   # its names in a folder written before the contract
    shares: bool = False                              # may go into a folder holding other files
    fixed: tuple[str, ...] = ()                       # names it always writes: checked before any work


EXPORT = Kind("a mudpuppy export or merge", "export.json", _adopt_export)
EVAL = Kind("an evaluation", "eval.json", _adopt_eval, shares=True, fixed=("eval.json", "eval.md"))
ADAPTER = Kind("a converted adapter")
KINDS = (EXPORT, EVAL)                                # those a folder inside a run may hold


# --------------------------------------------------------------------------- the marker
def earlier_output(folder: Path, kind: Kind) -> list[str] | None:
    """The names an earlier output of `kind` holds in `folder` (those still there), or None when the folder
    holds none: what its record lists, or for a record from before the contract, what `kind.adopt` allows."""
    record = read_json(Path(folder) / kind.record) if kind.record else None
    if record is None:
        return None
    if record.get("contract") == CONTRACT and isinstance(record.get("files"), list):
        present = set(entries(folder))
        return [n for n in record["files"] if isinstance(n, str) and n in present]
    return kind.adopt(Path(folder), record) if kind.adopt else []


def stamp(folder: Path, kind: Kind, names, **extra) -> None:
    """`names` written into the record of `kind` in `folder` as what its output wrote (the record made if
    missing: the placeholder that marks a folder while an output moves in)."""
    path = Path(folder) / kind.record
    record = read_json(path) or {}
    record.update(files=sorted(names), contract=CONTRACT, **extra)
    write_json_atomic(path, record)


def holds_output(folder: Path) -> bool:
    return any(earlier_output(folder, kind) is not None for kind in KINDS)


def remove_output(folder: Path) -> list[str]:
    """Every output's own names in `folder` (an output inside a run being replaced); the folder goes too when
    nothing else is left. Returns what stays (the user's); their folder keeps an emptied record, so the run's
    next output may go there again."""
    emptied = []
    for kind in KINDS:
        names = earlier_output(folder, kind)
        if names is not None:
            remove_names(folder, names)
            emptied.append(kind)
    left = entries(folder)
    if not left:
        folder.rmdir()
        return []
    for kind in emptied:
        stamp(folder, kind, [], emptied=True)
    return [n for n in left if n not in {k.record for k in emptied}]


def remove_names(folder: Path, names) -> None:
    for name in names:
        if not name or "/" in name or name in (".", ".."):
            continue                     # a record someone edited never reaches outside its folder
        path = Path(folder) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)    # a link goes, never what it points to


def entries(folder: Path) -> list[str]:
    """What `folder` holds ([] for a folder that does not exist)."""
    try:
        return sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []


def read_json(path: Path) -> dict | None:
    """A record or marker file's object; None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_record(folder: Path, kind: Kind, record: dict) -> None:
    """An output's record written into its staging folder; publishing stamps the names it wrote into it."""
    (Path(folder) / kind.record).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
