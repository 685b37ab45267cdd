"""The files a run reads and writes, checked in plain Python before any runtime touches them.

Reading: a damaged file (cut short by a full disk or a killed process, or
not what its name says) must end in one message naming it, not in a
MemoryError from a safetensors header that claims 2^40 bytes or in a
traceback from deep inside a tokenizer. So before safetensors, torch, mlx
or tokenizers open a file, its structure is checked here: the safetensors
header against the file's size, JSON parsed, a torch file's zip directory
and pickle stream walked (never executed), a torch.distributed.checkpoint
`.metadata` unpickled with an allow-list of the classes DCP writes.

Writing: a full disk surfaces as an OSError from Python, a SafetensorError
from Rust, or a bare RuntimeError from torch's zip writer (no errno at
all), so `write_errors` asks the file system whether it is full instead of
trusting the exception's type.

Caching: tokenized data and converted models live under one folder, `cache_dir`.

No torch or mlx here: every backend and the CLI share these checks.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import pickletools
import shutil
import struct
import zipfile
from pathlib import Path

from .errors import MudpuppyError

MAX_SAFETENSORS_HEADER = 100 * 2**20      # safetensors itself refuses headers over 100 MB
FULL_PARSE_LIMIT = 16 * 2**20             # JSON above this (a big tokenizer.json) is checked by its ends only
NEARLY_FULL = 8 * 2**20                   # free bytes under which a failed write is put down to a full disk


def cache_dir(kind: str = "") -> Path:
    """The folder mudpuppy caches what it can rebuild in (tokenized data, converted models), `kind` a folder
    inside it: $MUDPUPPY_CACHE if set (it moves the whole cache), else $XDG_CACHE_HOME/mudpuppy, else
    ~/.cache/mudpuppy."""
    explicit = os.environ.get("MUDPUPPY_CACHE")
    if explicit:
        root = Path(explicit).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "mudpuppy"
    return root / kind if kind else root


class CorruptFile(MudpuppyError):
    """A file that cannot be what it claims to be: truncated, overwritten, or crafted."""


class WriteFailed(MudpuppyError):
    """Writing a checkpoint or the run's result failed (a full disk, no permission); nothing older was lost."""


# --------------------------------------------------------------------------- reading

def check_safetensors(path: str | Path) -> None:
    """The 8-byte header length and every tensor's offsets must fit inside the file."""
    path = Path(path)
    size = _size(path)
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CorruptFile(f"{path}: not a safetensors file ({size} bytes, shorter than its 8-byte header "
                              "length); it was cut short while being written")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, MAX_SAFETENSORS_HEADER):
            raise CorruptFile(f"{path}: not a safetensors file (its header claims {length:,} bytes, the file has "
                              f"{size:,}); the file is damaged or was cut short")
        raw = fh.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptFile(f"{path}: not a safetensors file (its header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise CorruptFile(f"{path}: not a safetensors file (its header is not a JSON object)")
    data = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise CorruptFile(f"{path}: not a safetensors file (tensor {name!r} has no valid data_offsets)")
        if offsets[1] > data:
            raise CorruptFile(f"{path}: tensor {name!r} ends at byte {offsets[1]:,} of a data section of "
                              f"{data:,}; the file was cut short while being written")


def read_json(path: str | Path):
    """A JSON file's content, or one message naming the file when it does not parse."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorruptFile(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptFile(f"{path}: cannot be read as JSON ({exc}); the file is damaged or was cut short "
                          "while being written") from None


def check_json(path: str | Path) -> None:
    """read_json's check; a very large file (a tokenizer.json) only has to open and close its object:
    a file cut short never ends in its closing bracket."""
    path = Path(path)
    if _size(path) <= FULL_PARSE_LIMIT:
        read_json(path)
        return
    with path.open("rb") as fh:
        first = fh.read(64).lstrip()[:1]
        fh.seek(-64, os.SEEK_END)
        last = fh.read().rstrip()[-1:]
    if (first, last) not in ((b"{", b"}"), (b"[", b"]")):
        raise CorruptFile(f"{path}: cannot be read as JSON (it does not end where it began); the file is "
                          "damaged or was cut short while being written")


def check_torch_file(path: str | Path) -> None:
    """A torch.save file: a zip whose pickle stream is whole. The pickle is walked, never run
    (torch.load(weights_only=True) later decides which classes it may build)."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
            if not pickles:
                raise zipfile.BadZipFile("no data.pkl inside")
            _walk_pickle(archive.read(pickles[0]))
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise CorruptFile(f"{path}: not a readable torch file ({exc}); the file is damaged or was cut short "
                          "while being written") from None


def check_zip(path: str | Path) -> None:
    """A zip archive (numpy's .npz) whose directory reads."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path):
            pass
    except (OSError, zipfile.BadZipFile) as exc:
        raise CorruptFile(f"{path}: not a readable archive ({exc}); the file is damaged or was cut short") from None


CHECKS = {".safetensors": check_safetensors, ".json": check_json, ".pt": check_torch_file, ".npz": check_zip}

# The JSON files transformers, PEFT, tokenizers and mlx-lm read from a model or adapter directory; others
# there (a run's run_summary.json, an eval report) are nobody's input and are left alone.
MODEL_JSON = {"config.json", "generation_config.json", "adapter_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
              "chat_template.json", "preprocessor_config.json", "processor_config.json",
              "model.safetensors.index.json"}


def check_directory(directory: str | Path, everything: bool = False) -> None:
    """The files a loader reads from a model, adapter or run directory (not its subdirectories): safetensors
    and MODEL_JSON; with `everything` (a checkpoint: all of it is ours), every file that has a check."""
    for path in sorted(Path(directory).iterdir()):
        check = CHECKS.get(path.suffix)
        if everything or path.suffix == ".safetensors" or path.name in MODEL_JSON:
            if check is not None and path.is_file():
                check(path)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "*.model", "tokenizer.model.*", "tekken.json",
                   "*.tiktoken")


def check_model_files(directory: str | Path) -> None:
    """A model directory (it holds config.json) must hold weights and a tokenizer: one cut short (a merge
    or copy killed half way, which the output contract no longer leaves under a final name, or an older
    one) is named in one message instead of a loader's traceback."""
    directory = Path(directory)
    weights = any(directory.glob("*.safetensors")) or any(directory.glob("pytorch_model*.bin"))
    tokenizer = any(any(directory.glob(pattern)) for pattern in TOKENIZER_FILES)
    missing = [what for what, ok in (("weights (*.safetensors)", weights),
                                     (f"tokenizer ({', '.join(TOKENIZER_FILES[:3])})", tokenizer)) if not ok]
    if missing:
        raise CorruptFile(f"{directory}: holds config.json but no {' and no '.join(missing)}: an incomplete model "
                          "folder (a merge, export or copy that stopped before it finished?); remove it and write "
                          "it again, or point at a complete model")


def _walk_pickle(data: bytes) -> None:
    for _ in pickletools.genops(data):
        pass


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise CorruptFile(f"{path}: missing") from None


# --------------------------------------------------------------------------- DCP metadata

# What torch.distributed.checkpoint pickles into `.metadata` (torch 2.13's metadata.py and filesystem.py);
# DCP reads it with plain pickle.load, which would run whatever a crafted file names.
DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32",
              "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
              "float8_e4m3fnuz", "float8_e5m2fnuz"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class AllowListUnpickler(pickle.Unpickler):
    """Builds only DCP_CLASSES, each through `resolve(module, name)`; anything else is refused before it loads."""

    def __init__(self, file, resolve, where: Path):
        super().__init__(file)
        self.resolve, self.where = resolve, where

    def find_class(self, module: str, name: str):
        if name not in DCP_CLASSES.get(module, ()):
            raise CorruptFile(f"{self.where}: refused: it names {module}.{name}, which a checkpoint's metadata "
                              "never holds; a file like this can run code when read, so it was not loaded")
        return self.resolve(module, name)

    def persistent_load(self, pid):
        raise CorruptFile(f"{self.where}: refused: a persistent reference, which a checkpoint's metadata never holds")


def load_dcp_metadata(path: str | Path, resolve):
    """A `.metadata` file unpickled through the allow-list; `resolve` returns the real class (torch side)
    or a stand-in (the plain check below)."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return AllowListUnpickler(fh, resolve, path).load()
    except CorruptFile:
        raise
    except FileNotFoundError:
        raise CorruptFile(f"{path}: missing") from None
    except Exception as exc:      # noqa: BLE001 - any failure to unpickle is a damaged file
        raise CorruptFile(f"{path}: not a readable checkpoint metadata file ({type(exc).__name__}: {exc})") from None


class _StandIn:
    """What check_dcp_dir builds in place of each allowed class: it takes any arguments and keeps its state."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], (dict, type(None))):
            state = {**(state[0] or {}), **(state[1] or {})}      # (dict, slots)
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


def check_dcp_dir(directory: str | Path) -> None:
    """A DCP checkpoint directory: its metadata through the allow-list, and every storage slice it
    names inside a file of the directory."""
    directory = Path(directory)
    metadata = load_dcp_metadata(directory / ".metadata", lambda module, name: _StandIn)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise CorruptFile(f"{directory / '.metadata'}: not a checkpoint metadata file (no storage table)")
    sizes: dict[str, int] = {}
    for info in storage.values():
        name, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if not isinstance(name, str) or not isinstance(offset, int) or not isinstance(length, int):
            raise CorruptFile(f"{directory / '.metadata'}: not a checkpoint metadata file (a bad storage entry)")
        if Path(name).name != name or name in ("", ".", ".."):
            raise CorruptFile(f"{directory / '.metadata'}: refused: it points outside its directory ({name!r})")
        if name not in sizes:
            sizes[name] = _size(directory / name)
        if offset < 0 or length < 0 or offset + length > sizes[name]:
            raise CorruptFile(f"{directory / name}: {sizes[name]:,} bytes, but the checkpoint's metadata has data "
                              f"up to byte {offset + length:,}; the file was cut short while being written")


# --------------------------------------------------------------------------- writing

def disk_problem(exc: BaseException, directory: str | Path) -> str | None:
    """Why a write into `directory` failed, when the cause is the file system's and not a bug: "disk full"
    (found by asking the file system: torch's zip writer reports a full disk without an errno) or the
    OSError's own reason (permission denied, read-only file system)."""
    full = "disk full (no space left on device)"
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return full if seen.errno == errno.ENOSPC else "disk full (disk quota exceeded)"
        if "no space left on device" in str(seen).lower() or "os error 28" in str(seen).lower():
            return full
        seen = seen.__cause__ or seen.__context__
    if nearly_full(directory):
        return full
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror or exc}{where}"
    return None


def nearly_full(directory: str | Path) -> bool:
    """Whether the file system of `directory` (or its nearest existing parent) has next to nothing left:
    under NEARLY_FULL bytes and under 1% of its size. Unknown counts as not full."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stats = os.statvfs(path)
    except (OSError, AttributeError):
        return False
    free = stats.f_bavail * stats.f_frsize
    return free < min(NEARLY_FULL, stats.f_blocks * stats.f_frsize / 100)


@contextlib.contextmanager
def write_errors(what: str, directory: str | Path, cleanup: Path | None = None, kept: str = ""):
    """Around a save: a failure of the file system becomes one WriteFailed naming `what`, after
    `cleanup` (the staging directory) is removed; a bug keeps its traceback (the staging goes too)."""
    try:
        yield
    except MudpuppyError:
        _remove(cleanup)
        raise
    except Exception as exc:
        problem = disk_problem(exc, directory)
        _remove(cleanup)
        if problem is None:
            raise
        raise WriteFailed(f"{what}: {problem}; {kept or 'nothing written before was changed'}") from exc


def write_json_atomic(path: str | Path, data) -> None:
    """`data` as indented JSON at `path`, written beside it and renamed over it: a reader never sees half."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def move_into(staging: Path, target: Path) -> None:
    """Each entry of `staging` renamed into `target` (same file system: a rename never half-copies), replacing
    what is there; then `staging` goes. A folder of the same name is replaced whole."""
    for entry in sorted(staging.iterdir()):
        dest = target / entry.name
        if entry.is_dir() and dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        os.replace(entry, dest)
    staging.rmdir()


def _remove(path: Path | None) -> None:
    if path is not None and path.exists():
        shutil.rmtree(path, ignore_errors=True)

