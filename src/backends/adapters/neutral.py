"""The neutral form of an adapter (`Adapter`): what PEFT's and mlx-lm's layouts both hold, in PEFT's
orientation, with the file names both formats use and the checks both readers make."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from .tensors import AdapterError, RawTensor

CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
MLX_WEIGHTS = "adapters.safetensors"
MLX_SUBDIR = "mlx"             # where a mudpuppy run keeps its mlx-lm copy
PEFT_PREFIX = "base_model.model."
MUDPUPPY_KEY = "mudpuppy"      # our section inside an mlx-lm adapter_config.json
# The exact base mudpuppy trained on (backends.provenance.base_record), beside each adapter_config.json it writes;
# PEFT and mlx-lm never read it (PEFT warns on unknown keys in adapter_config.json, so it is a file of its own).
BASE_FILE = "mudpuppy_base.json"

# A scalar head (reward models) trains in full beside the adapter: PEFT's modules_to_save under a
# classification task. Its weight converts as it is, so only that use of modules_to_save is accepted.
HEAD_TASKS = ("SEQ_CLS", "TOKEN_CLS")
HEAD_MODULES = ["classifier", "score"]   # what PEFT's SEQ_CLS / TOKEN_CLS tasks list in modules_to_save

_LAYER_PATH = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(.+)$")


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


def is_head_weight(name: str) -> bool:
    """A top-level classification head's weight (score.weight, classifier.weight): trained in full."""
    module, _, leaf = name.rpartition(".")
    return module in HEAD_MODULES and leaf in ("weight", "bias")


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
