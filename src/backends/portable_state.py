"""Training state in a form every runtime reads, so a run checkpointed on one backend resumes on another.

Each backend's state.py keeps writing its own files (torch: trainer.pt; MLX:
optimizer.npz and trainer.json), which a resume on the same runtime reads
exactly as before, RNG streams included. Beside them it writes:

    portable_state.json          which backend and runtime wrote it, the optimizer, each tensor's update
                                 count, or why the state cannot move to another runtime ("refused")
    portable_state.safetensors   ``weight/<name>`` each trainable tensor as stored (bf16 stays bf16), and
                                 ``<moment>/<name>`` its optimizer moments in float32

Names and layouts are PEFT's (``base_model.model.<module>.lora_A.weight``, A [r, in], B [out, r], the DoRA
magnitude ``.lora_magnitude_vector``), the transformers model's own names in full fine-tuning. Moments
use torch's vocabulary: adamw ``exp_avg`` / ``exp_avg_sq``, sgd ``momentum_buffer``, adafactor
``row_var`` / ``col_var`` (factored, over the last two dimensions) or ``variance``.

A runtime whose native layout is the transpose of PEFT's (mlx-lm's lora_a [in, r]) describes each tensor
with a `Slot` and `to_native` / `to_portable` transpose it and its moments (adafactor's factors swap).
Only the RNG streams do not carry: a resume on another runtime draws other dropout masks and samples,
and says so in one line. No torch or mlx here: numpy, safetensors and JSON only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import MudpuppyError
from ..files import read_json, write_json_atomic
from .adapters import RawTensor, read_safetensors, write_safetensors

JSON_FILE = "portable_state.json"
TENSOR_FILE = "portable_state.safetensors"
FORMAT = 1
RUNTIME_OF = {"cpu": "torch", "cuda": "torch", "rocm": "torch", "mlx": "mlx"}
TORCH_BACKENDS = "cpu, cuda or rocm"
MOMENTS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",),
           "adafactor": ("row_var", "col_var", "variance")}
WEIGHT = "weight"


@dataclass(frozen=True)
class Slot:
    """One trainable tensor: the runtime's parameter name, its portable name, and whether the runtime
    holds the transpose of the portable layout."""

    native: str
    name: str
    transposed: bool = False


@dataclass
class PortableState:
    runtime: str                    # torch or mlx
    backend: str                    # cpu, cuda, rocm or mlx
    optimizer: str                  # training.optimizer
    weights: dict[str, RawTensor] = field(default_factory=dict)
    moments: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)   # tensor -> moment -> float32
    steps: dict[str, int] = field(default_factory=dict)                     # tensor -> optimizer updates
    refused: str | None = None      # why this state cannot resume on another runtime


# --------------------------------------------------------------------------- layouts

def flip_moments(moments: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The moments of a matrix's transpose: element-wise ones transposed; adafactor's row and column
    factors swap places (the transpose of a factored estimate is the estimate of the transpose)."""
    swap = {"row_var": "col_var", "col_var": "row_var"}
    return {swap.get(k, k): np.ascontiguousarray(np.swapaxes(v, -1, -2)) if v.ndim >= 2 else v
            for k, v in moments.items()}


def to_portable(slot: Slot, weight: RawTensor, moments: dict[str, np.ndarray]):
    if not slot.transposed:
        return weight, moments
    return weight.transposed(), flip_moments(moments)


to_native = to_portable             # a transpose undoes itself


# --------------------------------------------------------------------------- files

def write_state(path: str | Path, state: PortableState) -> None:
    path = Path(path)
    record = {"format": FORMAT, "written_by": {"runtime": state.runtime, "backend": state.backend},
              "optimizer": state.optimizer, "refused": state.refused}
    if state.refused is None:
        tensors = {f"{WEIGHT}/{n}": t for n, t in state.weights.items()}
        for name, moments in state.moments.items():
            tensors.update({f"{m}/{name}": RawTensor("F32", np.asarray(v, np.float32)) for m, v in moments.items()})
        write_safetensors(path / TENSOR_FILE, tensors, {"format": "mudpuppy-portable"})
        record["steps"] = state.steps
        record["tensors"] = sorted(state.weights)
    write_json_atomic(path / JSON_FILE, record)


def read_state(path: str | Path) -> PortableState | None:
    """The portable state of the checkpoint at `path`; None for one written before it was kept."""
    path = Path(path)
    if not (path / JSON_FILE).is_file():
        return None
    record = read_json(path / JSON_FILE)
    by = record.get("written_by") if isinstance(record, dict) else None
    if not isinstance(by, dict) or record.get("format") != FORMAT:
        raise MudpuppyError(f"{path / JSON_FILE}: not a portable training state this mudpuppy reads "
                            f"(format {record.get('format') if isinstance(record, dict) else None!r})")
    state = PortableState(by.get("runtime"), by.get("backend"), record.get("optimizer"),
                          refused=record.get("refused"))
    if state.refused is not None:
        return state
    tensors, _ = read_safetensors(path / TENSOR_FILE)
    for key, tensor in tensors.items():
        kind, _, name = key.partition("/")
        if kind == WEIGHT:
            state.weights[name] = tensor
        else:
            state.moments.setdefault(name, {})[kind] = tensor.to_float32()
    state.steps = {k: int(v) for k, v in (record.get("steps") or {}).items()}
    return state


def written_by(path: str | Path) -> tuple[str | None, str | None]:
    """(runtime, backend) that wrote a checkpoint: its portable record, else told by its native files
    (a checkpoint from before the record: its backend unknown)."""
    path = Path(path)
    if (path / JSON_FILE).is_file():
        record = read_json(path / JSON_FILE)
        by = record.get("written_by") if isinstance(record, dict) else None
        if not isinstance(by, dict):
            raise MudpuppyError(f"{path / JSON_FILE}: does not say which runtime wrote the checkpoint "
                                "(no \"written_by\" object); the file was changed after it was written")
        return by.get("runtime"), by.get("backend")
    if (path / "trainer.pt").is_file() or (path / "sharded").is_dir():
        return "torch", None
    if (path / "optimizer.npz").is_file():
        return "mlx", "mlx"
    return None, None


# --------------------------------------------------------------------------- resuming elsewhere

def foreign_state(path: str | Path, backend: str, optimizer: str) -> PortableState | None:
    """None when the checkpoint at `path` was written by `backend`'s runtime (its own files resume it
    exactly); else its portable state, checked to fit, with one line on stderr saying what differs.
    Refused with one message naming the checkpoint and the reason when it cannot carry over."""
    path, runtime = Path(path), RUNTIME_OF[backend]
    by_runtime, by_backend = written_by(path)
    if by_runtime in (None, runtime):
        return None
    where = TORCH_BACKENDS if by_runtime == "torch" else by_backend
    state = read_state(path)
    if state is None:
        raise MudpuppyError(f"cannot resume checkpoint {path} on the {backend} backend: it was written by the "
                            f"{by_runtime} runtime before mudpuppy kept a runtime-neutral copy of the training state; "
                            f"resume it with --backend {where}")
    if state.refused is not None:
        raise MudpuppyError(f"cannot resume checkpoint {path} on the {backend} backend ({runtime}): {state.refused}; "
                            f"resume it with --backend {where}")
    if state.optimizer != optimizer:
        raise MudpuppyError(f"cannot resume checkpoint {path}: its optimizer state is {state.optimizer}'s and this "
                            f"config's training.optimizer is {optimizer}; use the optimizer that wrote it")
    print(f"note: {path} was written by the {by_backend} backend ({by_runtime}); resuming on {backend} "
          f"({runtime}), dropout and sampling draws will differ from an uninterrupted run",
          file=sys.stderr, flush=True)
    return state


def single_step_count(path: str | Path, state: PortableState) -> int:
    """The one update count of a state whose tensors all had the same number of updates (a runtime that
    counts steps once for all tensors needs it); refused otherwise."""
    counts = set(state.steps.values())
    if len(counts) > 1:
        raise MudpuppyError(f"cannot resume checkpoint {path} on the mlx backend: its tensors had different numbers "
                            f"of optimizer updates ({min(counts)} to {max(counts)}), and MLX's optimizer counts one "
                            "for all; resume it on the backend that wrote it")
    return counts.pop() if counts else 0

