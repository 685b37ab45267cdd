"""Move LoRA and DoRA adapters between PEFT's layout and mlx-lm's, losslessly.

The two libraries store the same numbers differently:

=====================  ========================================  ==============================
                       PEFT (adapter_model.safetensors)          mlx-lm (adapters.safetensors)
=====================  ========================================  ==============================
down-projection        ``base_model.model.<path>.lora_A.weight`` ``<path>.lora_a``  [in, r]
                       [r, in]
up-projection          ``<...>.lora_B.weight``  [out, r]         ``<path>.lora_b``  [r, out]
DoRA magnitude         ``<...>.lora_magnitude_vector`` [out]     ``<path>.m``  [out]
scaling                ``lora_alpha`` / r (rsLoRA: / sqrt(r))    ``scale``, an absolute factor
which modules          ``target_modules`` (leaf names)           ``keys`` (paths inside a block),
                                                                 ``num_layers`` (last N blocks)
=====================  ========================================  ==============================

Both compute base(x) + scale * (x @ A^T) @ B^T, so a conversion is a rename,
a transpose and a scale; tensors are copied bit for bit in their stored dtype
(bf16 included, which numpy cannot represent, so safetensors files are read
and written here as raw bytes). An mlx-lm copy written by mudpuppy carries the
PEFT config it came from, so PEFT -> mlx-lm -> PEFT gives back identical files.

Mixture-of-experts experts held as fused 3-D tensors (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``) take PEFT's ``target_parameters`` LoRA (``lora.ParamWrapper``): one
rank-r pair per expert, stored as ``<experts>[.base_layer].lora_A.weight`` [E*r, in] (expert e's
rows at e*r...) and ``lora_B.weight`` [out, r*E] (expert e's k-th column at k*E + e); a module
with both tensors targeted nests two wrappers, gate_up_proj the inner (``.base_layer``) one, as
PEFT wraps the parameters in the order the module defines them. mlx-lm's layout has no fused
gate/up: the mlx copy holds mlx-lm's LoRASwitchLinear pairs on ``gate_proj``, ``up_proj`` (the same
A twice, B's two parts) and ``down_proj``, which `mlx_lm.load` reads and which convert back exactly
(their two A's must be equal). Where the SwitchGLU sits and how gate_up's rows hold gate and up
is the model's, recorded by the MLX backend (`Adapter.expert_layout`).

Pure numpy and json: the torch backend, the MLX backend and the CLI all use
this module, and none of them should have to import the other's runtime.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import MudpuppyError
from ..files import check_safetensors, write_json_atomic

CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
MLX_WEIGHTS = "adapters.safetensors"
MLX_SUBDIR = "mlx"             # where a mudpuppy run keeps its mlx-lm copy
PEFT_PREFIX = "base_model.model."
MUDPUPPY_KEY = "mudpuppy"      # our section inside an mlx-lm adapter_config.json
# The exact base mudpuppy trained on (backends.provenance.base_record), beside each adapter_config.json it writes;
# PEFT and mlx-lm never read it (PEFT warns on unknown keys in adapter_config.json, so it is a file of its own).
BASE_FILE = "mudpuppy_base.json"

# PEFT options that change what the weights mean; an adapter using any of them
# has no faithful mlx-lm equivalent, so it is refused rather than converted wrongly.
PEFT_UNCONVERTIBLE = {
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "modules_to_save": "fully trained extra modules",
    "lora_bias": "trained LoRA biases",
    "fan_in_fan_out": "Conv1D (fan_in_fan_out) weights",
    "layer_replication": "layer replication",
    "trainable_token_indices": "trainable token embeddings",
    "use_qalora": "QA-LoRA",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
}

# A scalar head (reward models) trains in full beside the adapter: PEFT's modules_to_save under a
# classification task. Its weight converts as it is, so only that use of modules_to_save is accepted.
HEAD_TASKS = ("SEQ_CLS", "TOKEN_CLS")
HEAD_MODULES = ["classifier", "score"]   # what PEFT's SEQ_CLS / TOKEN_CLS tasks list in modules_to_save

# The fused expert tensors PEFT's target_parameters may adapt, in the order experts modules define them
# (which is PEFT's nesting order: the first is wrapped innermost).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
MLX_STACKS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_LAYER_PATH = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(.+)$")


class AdapterError(MudpuppyError):
    """A directory that is not an adapter, or an adapter that cannot be converted."""


# --------------------------------------------------------------------------- tensors


@dataclass
class RawTensor:
    """A tensor as stored: its safetensors dtype tag and its elements (bf16 held as uint16 bits)."""

    dtype: str
    array: np.ndarray

    def transposed(self) -> RawTensor:
        return RawTensor(self.dtype, np.ascontiguousarray(self.array.T))

    def to_float32(self) -> np.ndarray:
        if self.dtype == "BF16":
            return (self.array.astype(np.uint32) << 16).view(np.float32)
        return self.array.astype(np.float32)

    def equals(self, other: RawTensor) -> bool:
        return (self.dtype == other.dtype and self.array.shape == other.array.shape
                and self.array.tobytes() == other.array.tobytes())


def read_safetensors(path: Path) -> tuple[dict[str, RawTensor], dict[str, str]]:
    """Every tensor of a safetensors file, and its metadata."""
    check_safetensors(path)       # header and offsets against the file's size, before it is read whole
    data = Path(path).read_bytes()
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
    except (struct.error, ValueError) as exc:
        raise AdapterError(f"{path}: not a safetensors file ({exc})") from None
    meta = header.pop("__metadata__", None) or {}
    body = memoryview(data)[8 + size :]
    tensors = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise AdapterError(f"{path}: tensor {name} has dtype {info['dtype']}; adapters hold floats")
        begin, end = info["data_offsets"]
        array = np.frombuffer(body[begin:end], dtype=_DTYPES[info["dtype"]]).reshape(info["shape"])
        tensors[name] = RawTensor(info["dtype"], array.copy())
    return tensors, meta


def write_safetensors(path: Path, tensors: dict[str, RawTensor], metadata: dict[str, str]) -> None:
    """Write atomically (a temporary file, then a rename): a crash never leaves half an adapter."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    chunks, offset = [], 0
    for name in sorted(tensors):
        raw = np.ascontiguousarray(tensors[name].array).astype(_DTYPES[tensors[name].dtype], copy=False)
        blob = raw.astype(raw.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": tensors[name].dtype, "shape": list(raw.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        chunks.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format asks for an 8-byte aligned data section
    tmp = Path(str(path) + ".tmp")
    with tmp.open("wb") as fh:
        fh.write(struct.pack("<Q", len(head)))
        fh.write(head)
        for blob in chunks:
            fh.write(blob)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the neutral form


@dataclass
class ModuleAdapter:
    """One adapted linear layer in PEFT's orientation: A [r, in], B [out, r], magnitude [out]."""

    lora_a: RawTensor
    lora_b: RawTensor
    magnitude: RawTensor | None = None


@dataclass
class ExpertAdapter:
    """PEFT's LoRA on one fused expert tensor, in PEFT's layout: A [E*r, in], B [out, r*E]."""

    lora_a: RawTensor
    lora_b: RawTensor

    def factors(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """Per expert: A [E, r, in] and B [E, out, r] (PEFT's get_delta_factors reshapes)."""
        a, b = self.lora_a.array, self.lora_b.array
        experts = a.shape[0] // r
        return (np.ascontiguousarray(a.reshape(experts, r, a.shape[1])),
                np.ascontiguousarray(b.reshape(b.shape[0], r, experts).transpose(2, 0, 1)))

    @classmethod
    def from_factors(cls, dtype: str, a: np.ndarray, b: np.ndarray) -> ExpertAdapter:
        experts, r, in_dims = a.shape
        return cls(RawTensor(dtype, np.ascontiguousarray(a.reshape(experts * r, in_dims))),
                   RawTensor(dtype, np.ascontiguousarray(b.transpose(1, 2, 0).reshape(b.shape[1], r * experts))))


def split_rows(fused: np.ndarray, split: str, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(gate, up) out of gate_up_proj's output rows: halves (Qwen3-MoE, Mixtral) or interleaved (gpt-oss)."""
    index = [slice(None)] * fused.ndim
    half = fused.shape[axis] // 2
    parts = (slice(0, None, 2), slice(1, None, 2)) if split == "interleaved" else (slice(0, half), slice(half, None))
    out = []
    for part in parts:
        index[axis] = part
        out.append(np.ascontiguousarray(fused[tuple(index)]))
    return out[0], out[1]


def join_rows(gate: np.ndarray, up: np.ndarray, split: str, axis: int) -> np.ndarray:
    if split != "interleaved":
        return np.concatenate([gate, up], axis=axis)
    out = np.stack([gate, up], axis=axis + 1 if axis >= 0 else axis)
    shape = list(gate.shape)
    shape[axis] *= 2
    return out.reshape(shape)


@dataclass
class Adapter:
    """A LoRA or DoRA adapter, independent of the library that wrote it."""

    kind: str                           # "lora" or "dora"
    r: int
    alpha: float
    modules: dict[str, ModuleAdapter]   # module path (e.g. model.layers.0.self_attn.q_proj) -> weights
    rslora: bool = False
    dropout: float = 0.0
    base_model: str | None = None
    peft_config: dict | None = None     # the PEFT config it was read from, written back verbatim
    num_layers: int = -1                # mlx-lm's "last N blocks"; -1 = every block
    target_modules: list[str] | None = None  # PEFT's target_modules; None: each module's path in its block
    extra: dict = field(default_factory=dict)  # mudpuppy notes kept with the mlx-lm copy (e.g. quantization)
    task_type: str = "CAUSAL_LM"        # PEFT's task; SEQ_CLS / TOKEN_CLS carry a head in `full`
    full: dict[str, RawTensor] = field(default_factory=dict)  # fully trained head weights, e.g. score.weight
    # fused expert tensor (model.layers.0.mlp.experts.down_proj) -> its PEFT target_parameters LoRA
    experts: dict[str, ExpertAdapter] = field(default_factory=dict)
    # experts module (model.layers.0.mlp.experts) -> (its SwitchGLU's path in mlx-lm, gate_up's row split)
    expert_layout: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        """mlx-lm's absolute multiplier: PEFT's lora_alpha / r, or / sqrt(r) with rsLoRA."""
        return self.alpha / (self.r ** 0.5 if self.rslora else self.r)

    def layer_indices(self) -> list[int]:
        return sorted({int(m.group(1)) for p in self.modules if (m := _LAYER_PATH.match(p))})

    def block_keys(self) -> list[str]:
        """mlx-lm's `keys`: a module's path inside its block, or its full path outside the blocks."""
        return sorted({(m.group(2) if (m := _LAYER_PATH.match(p)) else p) for p in self.modules})

    def target_parameters(self) -> list[str]:
        """PEFT's target_parameters names (``experts.down_proj``): the experts module's leaf and the tensor."""
        return sorted({".".join(p.split(".")[-2:]) for p in self.experts})


# --------------------------------------------------------------------------- formats


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


def adapter_from_peft(config: dict, tensors: dict[str, RawTensor], where: Path | str = "<peft>") -> Adapter:
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{where}: peft_type {config.get('peft_type')!r} is not convertible; only LoRA "
                           "and DoRA adapters (peft_type LORA) have an mlx-lm equivalent")
    task = config.get("task_type") or "CAUSAL_LM"
    head_only = task in HEAD_TASKS and set(config.get("modules_to_save") or []) <= set(HEAD_MODULES)
    used = [f"{key} ({why})" for key, why in PEFT_UNCONVERTIBLE.items()
            if config.get(key) and not (key == "modules_to_save" and head_only)]
    if used:
        raise AdapterError(f"{where}: this adapter uses {', '.join(used)}, which mlx-lm adapters cannot express")
    modules: dict[str, dict[str, RawTensor]] = {}
    full: dict[str, RawTensor] = {}
    expert_parts: dict[str, dict[str, RawTensor]] = {}
    wrapped = expert_targets(config.get("target_parameters") or [], where)
    suffixes = {".lora_A.weight": "a", ".lora_B.weight": "b", ".lora_magnitude_vector": "m",
                ".lora_magnitude_vector.weight": "m"}
    for name, tensor in tensors.items():
        if head_only and is_head_weight(name[len(PEFT_PREFIX):]) and name.startswith(PEFT_PREFIX):
            full[name[len(PEFT_PREFIX):]] = tensor
            continue
        hit = next((s for s in suffixes if name.endswith(s)), None)
        if hit is None or not name.startswith(PEFT_PREFIX):
            raise AdapterError(f"{where}: tensor {name!r} is not a LoRA A/B matrix or DoRA magnitude "
                               "(embedding LoRA and extra trained modules do not convert)")
        path = name[len(PEFT_PREFIX) : -len(hit)]
        if (param := expert_param(path, wrapped)) is not None:
            if hit not in (".lora_A.weight", ".lora_B.weight"):
                raise AdapterError(f"{where}: {name}: PEFT adapts fused experts without DoRA")
            expert_parts.setdefault(param, {})[suffixes[hit]] = tensor
            continue
        modules.setdefault(path, {})[suffixes[hit]] = tensor
    dora = bool(config.get("use_dora"))
    r = int(config["r"])
    experts = _check_experts(expert_parts, r, where)
    adapter = Adapter(
        kind="dora" if dora else "lora", r=r, alpha=float(config["lora_alpha"]),
        modules=_check_modules(modules, r, dora, where, allow_empty=bool(experts)),
        rslora=bool(config.get("use_rslora")),
        dropout=float(config.get("lora_dropout") or 0.0), base_model=config.get("base_model_name_or_path"),
        peft_config=config, task_type=task, full=full, experts=experts)
    return adapter


def expert_targets(target_parameters, where) -> list[tuple[str, str]]:
    """PEFT's target_parameters as (module suffix, tensor name); only fused expert tensors convert."""
    out = []
    for target in target_parameters:
        module, _, param = str(target).rpartition(".")
        if param not in EXPERT_PARAMS or not module:
            raise AdapterError(f"{where}: target_parameters {target!r}: only fused expert tensors "
                               f"({', '.join(EXPERT_PARAMS)}) convert to mlx-lm")
        out.append((module, param))
    return out


def expert_param(path: str, wrapped: list[tuple[str, str]]) -> str | None:
    """The fused tensor a PEFT key's module path adapts (``experts.base_layer`` -> gate_up_proj), or None.

    PEFT nests one lora.ParamWrapper per targeted tensor of a module, the first the module defines
    innermost: with n of them, the wrapper under d ``.base_layer`` hops adapts the (n-1-d)-th."""
    if not wrapped:
        return None
    parts = path.split(".")
    depth = 0
    while parts and parts[-1] == "base_layer":
        parts.pop()
        depth += 1
    module = ".".join(parts)
    params = [p for p in EXPERT_PARAMS
              if any(p == param and (module == m or module.endswith("." + m)) for m, param in wrapped)]
    if not params:
        return None
    if depth >= len(params):
        raise AdapterError(f"PEFT key {path}: nested deeper than the {len(params)} expert tensor(s) it targets")
    return f"{module}.{params[len(params) - 1 - depth]}"


def _check_experts(found: dict[str, dict[str, RawTensor]], r: int, where) -> dict[str, ExpertAdapter]:
    out = {}
    for path, parts in sorted(found.items()):
        if "a" not in parts or "b" not in parts:
            raise AdapterError(f"{where}: {path} has only one of its two LoRA matrices")
        a, b = parts["a"].array, parts["b"].array
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] % r or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{where}: {path} has A {a.shape} and B {b.shape}, which do not fit rank {r} "
                               "per expert")
        out[path] = ExpertAdapter(parts["a"], parts["b"])
    return out


def is_head_weight(name: str) -> bool:
    """A top-level classification head's weight (score.weight, classifier.weight): trained in full."""
    module, _, leaf = name.rpartition(".")
    return module in HEAD_MODULES and leaf in ("weight", "bias")


def adapter_from_mlx(config: dict, tensors: dict[str, RawTensor], where: Path | str = "<mlx>") -> Adapter:
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise AdapterError(f"{where}: fine_tune_type {kind!r} is a full fine-tune, not an adapter; "
                           "only lora and dora adapters convert")
    params = config.get("lora_parameters") or {}
    if "rank" not in params or "scale" not in params:
        raise AdapterError(f"{where}: lora_parameters must give rank and scale (mlx-lm's adapter_config schema)")
    modules: dict[str, dict[str, RawTensor]] = {}
    full: dict[str, RawTensor] = {}
    leaves = {"lora_a": "a", "lora_b": "b", "m": "m"}
    ours = config.get(MUDPUPPY_KEY) or {}
    layout = {m: (v["mlx"], v["split"]) for m, v in (ours.get("experts") or {}).items()}
    tensors = dict(tensors)
    experts = experts_from_mlx(tensors, layout, int(params["rank"]), where)   # takes its tensors out
    for name, tensor in tensors.items():
        if is_head_weight(name):
            full[name] = tensor
            continue
        path, _, leaf = name.rpartition(".")
        if leaf not in leaves or not path:
            raise AdapterError(f"{where}: tensor {name!r} is not a lora_a/lora_b/m adapter weight")
        if tensor.array.ndim != (1 if leaf == "m" else 2) or "embed" in path.rsplit(".", 1)[-1]:
            raise AdapterError(f"{where}: {name} belongs to a mixture-of-experts or embedding LoRA, "
                               "which PEFT's LoRA layout does not share")
        # PEFT orientation: A [r, in], B [out, r].
        modules.setdefault(path, {})[leaves[leaf]] = tensor if leaf == "m" else tensor.transposed()
    r = int(params["rank"])
    peft_config = ours.get("peft_config")
    rslora = bool(peft_config.get("use_rslora")) if peft_config else False
    scale = float(params["scale"])
    alpha = float(peft_config["lora_alpha"]) if peft_config else scale * r
    task = ours.get("task_type") or (peft_config or {}).get("task_type") or "CAUSAL_LM"
    if full and task not in HEAD_TASKS:
        raise AdapterError(f"{where}: {', '.join(full)} is a trained head, but the config names no "
                           "classification task (mudpuppy.task_type SEQ_CLS or TOKEN_CLS)")
    adapter = Adapter(
        kind=kind, r=r, alpha=alpha, modules=_check_modules(modules, r, kind == "dora", where, bool(experts)),
        rslora=rslora, dropout=float(params.get("dropout") or 0.0), base_model=config.get("model"),
        peft_config=peft_config, num_layers=int(config.get("num_layers", -1)), task_type=task, full=full,
        extra={k: v for k, v in ours.items() if k not in ("peft_config", "task_type", "experts")},
        experts=experts, expert_layout=layout)
    if peft_config is not None and abs(adapter.scale - scale) > 1e-6 * max(1.0, abs(scale)):
        raise AdapterError(f"{where}: lora_parameters.scale {scale} disagrees with the PEFT config it records "
                           f"(lora_alpha {alpha}, r {r} give {adapter.scale}); the file was edited by hand")
    return adapter


def experts_from_mlx(tensors: dict[str, RawTensor], layout: dict[str, tuple[str, str]], r: int,
                     where) -> dict[str, ExpertAdapter]:
    """The expert adapters of an mlx-lm copy mudpuppy wrote (its LoRASwitchLinear pairs on gate_proj,
    up_proj, down_proj) back in PEFT's fused layout; removes their tensors from `tensors`."""
    out = {}
    for module, (stem, split) in sorted(layout.items()):
        for param, stacks in MLX_STACKS.items():
            names = [f"{stem}.{s}.{leaf}" for s in stacks for leaf in ("lora_a", "lora_b")]
            present = [n for n in names if n in tensors]
            if not present:
                continue
            if len(present) != len(names):
                raise AdapterError(f"{where}: {stem}: expert adapter incomplete (has {', '.join(present)})")
            got = {n: tensors.pop(n) for n in names}
            dtype = got[names[0]].dtype
            a = got[f"{stem}.{stacks[0]}.lora_a"].array
            if a.ndim != 3 or a.shape[1] != r:
                raise AdapterError(f"{where}: {stem}.{stacks[0]}.lora_a {a.shape} is not [experts, {r}, in]")
            if param == "gate_up_proj":
                if not got[f"{stem}.up_proj.lora_a"].equals(got[f"{stem}.gate_proj.lora_a"]):
                    raise AdapterError(
                        f"{where}: {stem}: gate_proj and up_proj hold different lora_a, i.e. two pairs; PEFT's "
                        "LoRA on the fused gate_up_proj is one pair per expert (train it with mudpuppy)")
                b = join_rows(got[f"{stem}.gate_proj.lora_b"].array, got[f"{stem}.up_proj.lora_b"].array, split, 1)
            else:
                b = got[f"{stem}.down_proj.lora_b"].array
            out[f"{module}.{param}"] = ExpertAdapter.from_factors(dtype, a, b)
    left = [n for n, t in tensors.items() if t.array.ndim == 3]
    if left:
        raise AdapterError(f"{where}: {left[0]} belongs to a mixture-of-experts LoRA this file does not map to "
                           "PEFT's fused experts (mlx-lm's own gate and up pairs have no PEFT equivalent)")
    return out


def _check_modules(found: dict[str, dict[str, RawTensor]], r: int, dora: bool, where,
                   allow_empty: bool = False) -> dict[str, ModuleAdapter]:
    if not found and not allow_empty:
        raise AdapterError(f"{where}: the adapter holds no weights")
    out = {}
    for path, parts in sorted(found.items()):
        if "a" not in parts or "b" not in parts:
            raise AdapterError(f"{where}: {path} has only one of its two LoRA matrices")
        a, b, m = parts["a"], parts["b"], parts.get("m")
        if a.array.ndim != 2 or b.array.ndim != 2 or a.array.shape[0] != r or b.array.shape[1] != r:
            raise AdapterError(f"{where}: {path} has A {a.array.shape} and B {b.array.shape}, "
                               f"which do not fit rank {r}")
        if dora and (m is None or m.array.shape != (b.array.shape[0],)):
            raise AdapterError(f"{where}: {path} is DoRA but has no magnitude vector of length {b.array.shape[0]}")
        if not dora and m is not None:
            raise AdapterError(f"{where}: {path} has a DoRA magnitude but the config does not say use_dora")
        out[path] = ModuleAdapter(a, b, m)
    return out


# --------------------------------------------------------------------------- writing


def peft_config_for(adapter: Adapter) -> dict:
    """The PEFT config to write: the original when there is one, else a minimal LoraConfig."""
    if adapter.peft_config is not None:
        return adapter.peft_config
    config = {
        "peft_type": "LORA", "task_type": adapter.task_type, "base_model_name_or_path": adapter.base_model,
        "r": adapter.r, "lora_alpha": _plain_number(adapter.alpha), "lora_dropout": adapter.dropout,
        "target_modules": adapter.target_modules or adapter.block_keys(), "use_dora": adapter.kind == "dora",
        "use_rslora": adapter.rslora, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": list(HEAD_MODULES) if adapter.full else None,
        "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
        "target_parameters": adapter.target_parameters() or None,
    }
    if adapter.num_layers != -1:
        # mlx-lm adapted only the last `num_layers` blocks; PEFT must not adapt the others.
        config["layers_to_transform"] = adapter.layer_indices()
    return config


def write_peft(adapter: Adapter, out: str | Path) -> Path:
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, mod in adapter.modules.items():
        tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"] = mod.lora_a
        tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"] = mod.lora_b
        if mod.magnitude is not None:
            tensors[f"{PEFT_PREFIX}{path}.lora_magnitude_vector"] = mod.magnitude
    tensors.update({f"{PEFT_PREFIX}{name}": tensor for name, tensor in adapter.full.items()})
    for path, ea in adapter.experts.items():
        tensors[f"{PEFT_PREFIX}{peft_expert_key(adapter, path)}.lora_A.weight"] = ea.lora_a
        tensors[f"{PEFT_PREFIX}{peft_expert_key(adapter, path)}.lora_B.weight"] = ea.lora_b
    write_safetensors(root / PEFT_WEIGHTS, tensors, {"format": "pt"})
    write_json_atomic(root / CONFIG_FILE, peft_config_for(adapter))
    return root


def peft_expert_key(adapter: Adapter, path: str) -> str:
    """PEFT's module name for a fused tensor's wrapper: the experts module, one ``.base_layer`` per wrapper
    nested outside it (expert_param's rule, backwards)."""
    module, _, param = path.rpartition(".")
    params = [p for p in EXPERT_PARAMS if f"{module}.{p}" in adapter.experts]
    return module + ".base_layer" * (len(params) - 1 - params.index(param))


def mlx_expert_tensors(adapter: Adapter) -> dict[str, RawTensor]:
    """The expert adapters as mlx-lm's LoRASwitchLinear pairs: lora_a [E, r, in], lora_b [E, out, r]."""
    out = {}
    for path, ea in adapter.experts.items():
        module, _, param = path.rpartition(".")
        if module not in adapter.expert_layout:
            raise AdapterError(f"{module}: an expert adapter needs the MLX model's layout to be written in mlx-lm's "
                               "form; load the adapter on the mlx backend and save it from there")
        stem, split = adapter.expert_layout[module]
        a, b = ea.factors(adapter.r)
        dtype = ea.lora_a.dtype
        if param == "gate_up_proj":
            gate, up = split_rows(b, split, 1)
            for stack, part in (("gate_proj", gate), ("up_proj", up)):
                out[f"{stem}.{stack}.lora_a"] = RawTensor(dtype, a)
                out[f"{stem}.{stack}.lora_b"] = RawTensor(dtype, part)
        else:
            out[f"{stem}.down_proj.lora_a"] = RawTensor(dtype, a)
            out[f"{stem}.down_proj.lora_b"] = RawTensor(dtype, b)
    return out


def mlx_config_for(adapter: Adapter) -> dict:
    ours = dict(adapter.extra)
    if adapter.expert_layout:
        ours["experts"] = {m: {"mlx": stem, "split": split} for m, (stem, split) in adapter.expert_layout.items()}
    ours["peft_config"] = peft_config_for(adapter)
    if adapter.full:
        ours["task_type"] = adapter.task_type
    return {
        "fine_tune_type": adapter.kind,
        # -1 is mlx-lm's "every block": adapters may sit on any subset of blocks, and
        # mlx-lm's extra layers then start with B = 0 (LoRA) or m = |W| (DoRA), changing nothing.
        "num_layers": -1,
        "lora_parameters": {"rank": adapter.r, "scale": adapter.scale, "dropout": adapter.dropout,
                            "keys": sorted(set(adapter.block_keys()) | expert_keys(adapter))},
        "model": adapter.base_model,
        MUDPUPPY_KEY: ours,
    }


def expert_keys(adapter: Adapter) -> set[str]:
    names = mlx_expert_tensors(adapter) if adapter.experts else {}
    return {(m.group(2) if (m := _LAYER_PATH.match(n)) else n).rpartition(".")[0] for n in names}


def write_mlx(adapter: Adapter, out: str | Path) -> Path:
    root = Path(out)
    tensors = mlx_expert_tensors(adapter)     # refused before anything is written where it cannot be
    root.mkdir(parents=True, exist_ok=True)
    for path, mod in adapter.modules.items():
        tensors[f"{path}.lora_a"] = mod.lora_a.transposed()
        tensors[f"{path}.lora_b"] = mod.lora_b.transposed()
        if mod.magnitude is not None:
            tensors[f"{path}.m"] = mod.magnitude
    tensors.update(adapter.full)   # a trained head keeps its model name (score.weight), as mlx-lm's weights do
    write_safetensors(root / MLX_WEIGHTS, tensors, {"format": "mlx"})
    write_json_atomic(root / CONFIG_FILE, mlx_config_for(adapter))
    return root


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
    written = write_peft(adapter, out) if to == "peft" else write_mlx(adapter, out)
    record = read_base_record(src) or local_base_record(adapter.base_model)
    if record is not None:
        record_base(written, record)
    return written


def local_base_record(base_model: str | None) -> dict | None:
    """The record of a base named by a local directory that knows its Hub id; None otherwise."""
    from .provenance import base_record_of_path, hub_id_of_dir

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
    from ..files import read_json

    path = Path(directory) / BASE_FILE
    if not path.is_file():
        return None
    record = read_json(path)
    if not isinstance(record, dict) or not record.get("given"):
        raise AdapterError(f"{path}: expected mudpuppy's record of the base model (an object with \"given\")")
    return record


def _plain_number(value: float):
    return int(value) if float(value).is_integer() else value


def choose_target_modules(linear: set[str], wanted, parameters: set[str] | frozenset = frozenset()) -> list[str]:
    """The adapter's target leaf names, from the model's linear leaf names and the config's wish.

    Shared by every backend so that `all-linear` and the error for a name that
    matches nothing read the same on torch and MLX. `parameters` are the fused
    expert tensors a mixture-of-experts model holds instead of per-expert linears
    (``experts.gate_up_proj``): names the config may list too, targeted through
    `choose_target_parameters` rather than as modules.
    """
    if wanted == "all-linear":
        if not linear and not parameters:
            raise MudpuppyError("adapter.target_modules: this model has no linear layers to adapt")
        return sorted(linear)
    missing = [w for w in wanted if w not in linear and w not in parameters]
    if missing:
        known = ", ".join(sorted(linear) + sorted(parameters))
        raise MudpuppyError(
            f"adapter.target_modules: {', '.join(missing)} match no linear layer in this model; "
            f"its linear layers are: {known}")
    return [w for w in wanted if w in linear]


def choose_target_parameters(parameters: set[str], wanted) -> list[str]:
    """The fused expert tensors to adapt (PEFT's ``target_parameters``, e.g. ``experts.down_proj``): every
    one under `all-linear`, since they hold most of a mixture-of-experts model's weights; else those named."""
    if wanted == "all-linear":
        return sorted(parameters)
    return [w for w in wanted if w in parameters]
