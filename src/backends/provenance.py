"""Where a base model came from: the record mudpuppy keeps beside each adapter, and what it names.

An adapter names its base in adapter_config.json (`base_model_name_or_path`) for readers elsewhere:
the Hub id where one is known (an alias's upstream model, a Hub id, a Hub snapshot or a directory whose
config records one), else the path as the user wrote it; never mudpuppy's cache. What mudpuppy itself
loads again is the record below (`base_record`), kept beside the adapter (adapters.BASE_FILE) and in
run_summary.json: the name as given, how it resolved, and where the weights truly came from.

Resolving stays in models.py (`resolve_model`, which remembers what it resolved in models.RESOLVED);
this file only reads names, paths and that memory, and never converts or downloads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from . import models
from .models import (
    COMPLETION_MARKER, HUB_ID, MODEL_ALIASES, PackagedGGUF, ResolvedModel, converted_dir_for, locate_package_dir,
    looks_like_local_path,
)

_SNAPSHOT = re.compile(r"/models--(?P<repo>[^/]+)/snapshots/(?P<commit>[^/]+)/?$")
_GGUF_TYPE = re.compile(r"[.-](?P<type>(?:I?Q\d\w*)|BF16|F16|F32)\.gguf$", re.IGNORECASE)


def alias_of_gguf(gguf_path: str | Path) -> tuple[str, PackagedGGUF] | None:
    """The alias whose packaged file `gguf_path` is, if any (found without importing the package)."""
    target = Path(gguf_path).expanduser().absolute()
    for name, alias in MODEL_ALIASES.items():
        if target.name != alias.filename:
            continue
        package_dir = locate_package_dir(alias.package)
        if package_dir is not None and (package_dir / alias.filename).absolute() == target:
            return name, alias
    return None


def gguf_type(gguf_path: str | Path) -> str:
    """The quantization a GGUF file's name declares (Q4_1, Q8_0, F16...), or plain "GGUF"."""
    found = _GGUF_TYPE.search(Path(gguf_path).name)
    return found["type"].upper() if found else "GGUF"


def hub_id_of_dir(directory: str | Path) -> tuple[str | None, str | None, bool | None]:
    """(Hub id, commit, whether its weights are the Hub's) for a local model directory: a Hub cache snapshot,
    mudpuppy's conversion of an alias's GGUF, or a config.json that records the id (`_name_or_path`, which
    transformers 4 saved); (None, None, None) when it names none."""
    path = Path(directory).expanduser().absolute()
    snap = _SNAPSHOT.search(path.as_posix())
    if snap:
        return snap["repo"].replace("--", "/"), snap["commit"], True
    marker = path / COMPLETION_MARKER
    if marker.is_file():
        try:
            source = json.loads(marker.read_text(encoding="utf-8")).get("source")
        except (OSError, ValueError):
            source = None
        found = alias_of_gguf(source) if source else None
        if found and found[1].upstream:
            return found[1].upstream, None, False
    config = path / "config.json"
    if config.is_file():
        try:
            named = json.loads(config.read_text(encoding="utf-8")).get("_name_or_path")
        except (OSError, ValueError, AttributeError):
            named = None
        if is_hub_id(named):
            return named, None, None
    return None, None, None


def is_hub_id(value) -> bool:
    """`org/name` that is not a path on this machine."""
    return (isinstance(value, str) and value.count("/") == 1 and bool(HUB_ID.match(value))
            and not looks_like_local_path(value) and not Path(value).expanduser().exists())


def classify(given: str) -> ResolvedModel | None:
    """What resolve_model would make of `given`, without converting or downloading anything: the local
    path where it is (or would be) known; None where it names nothing."""
    path = Path(given).expanduser()
    alias = None if path.exists() else MODEL_ALIASES.get(given.lower())
    if alias is not None:
        package_dir = locate_package_dir(alias.package)
        gguf_path = package_dir / alias.filename if package_dir is not None else None
        if gguf_path is not None and gguf_path.is_file():
            return ResolvedModel(converted_dir_for(gguf_path), "alias", str(gguf_path))
        return ResolvedModel(Path(), "alias", "")
    if path.is_dir():
        return ResolvedModel(path, "local", given)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ResolvedModel(converted_dir_for(path.resolve()), "gguf", str(path.resolve()))
    if not looks_like_local_path(given) and HUB_ID.match(given):
        return ResolvedModel(Path(), "hub", given)
    return None


def base_record(given: str, revision: str | None = None) -> dict[str, Any]:
    """The base `given` (model.base_model as written) as this process resolved it, or as it would resolve
    (nothing is converted or downloaded here)."""
    given = (given or "").strip()
    found = next((r for g, rev, r in reversed(list(models.RESOLVED.values())) if g == given and rev == revision), None)
    return record_of(given, revision, found or classify(given))


def base_record_of_path(local: str | Path) -> dict[str, Any]:
    """The record of the base loaded from the local directory `local`: as the user named it when this
    process resolved it, else the directory itself (a Hub snapshot or an alias's conversion still named)."""
    entry = models.RESOLVED.get(str(local))
    if entry is not None:
        return record_of(*entry)
    return record_of(str(local), None, ResolvedModel(Path(local), "local", str(local)))


def record_of(given: str, revision: str | None, resolved: ResolvedModel | None) -> dict[str, Any]:
    kind = resolved.kind if resolved is not None else "unknown"
    local = resolved.path.absolute() if resolved is not None and str(resolved.path) not in ("", ".") else None
    hub_id, commit, same = None, None, None
    source = None
    if kind == "alias":
        alias = MODEL_ALIASES[given.lower()]
        hub_id, same = alias.upstream or None, False
        source = resolved.origin or None
        weights = (f"the {gguf_type(alias.filename)} GGUF {alias.filename} shipped in the Python package "
                   f"{alias.package} ({alias.install}), dequantized to float32 by mudpuppy")
    elif kind == "gguf":
        source = resolved.origin
        packaged = alias_of_gguf(source)
        if packaged is not None:
            hub_id, same = packaged[1].upstream or None, False
        weights = f"the {gguf_type(source)} GGUF file {source}, dequantized to float32 by mudpuppy"
    elif kind == "hub":
        hub_id, same = given, True
        if local is not None:
            _, commit, _ = hub_id_of_dir(local)
        at = f" at commit {commit}" if commit else (f" at revision {revision}" if revision else "")
        weights = f"{given} as downloaded from the Hugging Face Hub{at}"
    elif kind == "local":
        hub_id, commit, same = hub_id_of_dir(local)
        weights = f"the model directory {local}"
        if hub_id and same:
            weights += f" (a Hub snapshot of {hub_id}{f' at commit {commit}' if commit else ''})"
        elif hub_id and same is False:
            weights += f" (mudpuppy's float32 conversion of a GGUF of {hub_id})"
        elif hub_id:
            weights += f" (its config.json records {hub_id})"
    else:
        weights = f"{given} (not found on this machine when recorded)"
    return {
        "base_model_name_or_path": hub_id or given,
        "given": given,
        "kind": kind,
        "hub_id": hub_id,
        "revision": revision,
        "commit": commit,
        "hub_weights": same,
        "weights": weights,
        "source": source,
        "local_path": str(local) if local is not None else None,
    }


def base_to_load(record: dict[str, Any]) -> tuple[str, str | None]:
    """(model.base_model, revision) that loads the exact base a record describes, on this machine if it can:
    the alias or Hub id as given (at the commit trained on), the GGUF or directory where it still is; the
    Hub id, else the name as given, where the local copy is gone."""
    given, kind = record.get("given") or "", record.get("kind")
    revision = record.get("commit") or record.get("revision")
    if kind == "alias" and given.lower() in MODEL_ALIASES:
        return given, None
    if kind == "hub":
        return given, revision
    for candidate in (record.get("source"), record.get("local_path"), given):
        if candidate and Path(candidate).expanduser().exists():
            return candidate, None
    if record.get("hub_id"):
        return record["hub_id"], revision if record.get("hub_weights") else None
    return given, None


def describe_provenance(record: dict[str, Any] | None, trained: bool = True) -> str:
    """One paragraph for a model card: which base, and what its weights truly were; `trained`: a fine-tune's
    base ("Trained on ..."), else the weights of a model exported as it is ("The weights are ...")."""
    if not record:
        return ""
    hub_id, given = record.get("hub_id"), record.get("given")
    opening = "Trained on" if trained else "The weights are"
    if record.get("kind") in ("alias", "gguf"):           # the weights say which file; say what it was called
        named = f"`{given}`" + (f" ({hub_id}, as a GGUF)" if hub_id else "")
        text = f"{opening} {named}: {record.get('weights')}."
    else:
        text = f"{opening} {record.get('weights')}."
    if hub_id and record.get("hub_weights") is False:
        text += (f" These are not the Hub's own weights of {hub_id}, which differ slightly (by the GGUF's "
                 "quantization): an adapter trained here loads on the Hub model but matches training there only "
                 f"approximately; `{given}` in mudpuppy loads the exact base again.")
    elif not hub_id:
        text += (" It names no Hugging Face Hub model, so `base_model_name_or_path` holds the path as given; "
                 "elsewhere, point it at a copy of the same model.")
    return text
