"""What every backend provides, and nothing more.

Training pipelines (`mudpuppy.training`) and evaluation are written against
these protocols only. Arrays cross the boundary as numpy (`data.Batch` in,
floats and numpy arrays out), so no pipeline ever imports torch or mlx.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from ..config import AdapterConfig, ModelConfig, TrainingConfig
    from ..data.batching import Batch


@dataclass
class Availability:
    """Result of a real probe: can this backend allocate and compute here?"""

    name: str
    available: bool
    reason: str = ""          # why not, when unavailable
    device: str = ""          # what it would run on, when available
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    loss: float               # mean loss per loss-carrying token over the whole step
    loss_tokens: int          # tokens that carried loss
    tokens: int               # real (non-padding) tokens processed
    grad_norm: float | None   # before clipping; None when not computed
    skipped: bool = False     # the update was not applied (non-finite loss or gradient)


@dataclass
class AdapterInfo:
    kind: str
    trainable_params: int
    total_params: int
    target_modules: list[str]


@runtime_checkable
class ModelHandle(Protocol):
    """A loaded model with its tokenizer; opaque to pipelines beyond these fields."""

    model: Any
    tokenizer: Any
    source: str                # where the weights came from (resolved path)


@runtime_checkable
class TrainerProtocol(Protocol):
    """Owns the optimizer state for one model. The pipeline owns the schedule."""

    def step(self, micro_batches: list["Batch"], lr: float) -> StepResult:
        """Forward and backward over each micro-batch, then one optimizer update."""

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state and RNG state, enough to continue exactly."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class BackendProtocol(Protocol):
    name: str
    device: str

    # -- models
    def load_model(self, model_cfg: "ModelConfig", precision: str = "auto") -> ModelHandle: ...

    def save_model(self, handle: ModelHandle, path: str) -> None: ...

    # -- adapters
    def attach_adapter(self, handle: ModelHandle, adapter_cfg: "AdapterConfig") -> AdapterInfo: ...

    def save_adapter(self, handle: ModelHandle, path: str) -> None: ...

    def load_adapter(self, handle: ModelHandle, path: str) -> None: ...

    def merge_and_save(self, handle: ModelHandle, path: str, dtype: str = "bfloat16") -> None:
        """Fold the adapter into the base weights and save a plain model directory."""

    # -- training state, for checkpoints and exact resume
    def save_training_state(self, handle: ModelHandle, trainer: TrainerProtocol, path: str) -> None:
        """Trainable weights, optimizer state and the runtime's RNG state, into directory `path`."""

    def load_training_state(self, handle: ModelHandle, trainer: TrainerProtocol, path: str) -> None: ...

    # -- compute
    def create_trainer(self, handle: ModelHandle, training_cfg: "TrainingConfig") -> TrainerProtocol: ...

    def evaluate_loss(self, handle: ModelHandle, batches: list["Batch"]) -> tuple[float, int]:
        """Summed token loss and the number of loss-carrying tokens."""

    def logits(self, handle: ModelHandle, batch: "Batch") -> "np.ndarray":
        """Float32 logits [batch, time, vocab]; for tests and parity checks."""

    def generate(
        self, handle: ModelHandle, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]
    ) -> list[list[int]]:
        """Greedy continuation token ids for each prompt (without the prompt)."""

    def seed(self, seed: int) -> None: ...
