"""What every backend provides, and nothing more.

Training pipelines (`mudpuppy.training`) and evaluation are written against
these protocols only. Arrays cross the boundary as numpy (`data.Batch` in,
floats and numpy arrays out), so no pipeline ever imports torch or mlx.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from pathlib import Path

    from ..config import AdapterConfig, GptqConfig, ModelConfig, QatConfig, TrainingConfig
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
    loss_tokens: int          # what the loss is averaged over: loss tokens (SFT), or an objective's count
    tokens: int               # real (non-padding) tokens processed
    grad_norm: float | None   # before clipping; None when not computed
    skipped: bool = False     # the update was not applied (non-finite loss or gradient)
    metrics: dict[str, float] = field(default_factory=dict)   # an objective's own numbers, averaged over the step


@dataclass(frozen=True)
class Sampling:
    """How `BackendProtocol.sample` draws each token: transformers' warpers, in its order.

    The logits are divided by `temperature`, then cut to the `top_k` most likely tokens
    (0: no cut), then to the smallest set whose probability reaches `top_p` (1.0: no cut),
    then tokens below `min_p` times the most likely one's probability are dropped (None:
    no cut); the token is drawn from what is left."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None


@dataclass
class AdapterInfo:
    kind: str
    trainable_params: int
    total_params: int
    target_modules: list[str]
    quantization: str | None = None   # what quantize_base did, for QLoRA
    # Per target group (attention, mlp, experts, router): {"params": its base weights, "adapted": how many of
    # those carry an adapter or train, "trainable": the parameters that adapt them}. Empty where not counted.
    groups: dict[str, dict[str, int]] = field(default_factory=dict)

    def describe(self) -> str:
        """The run log's adapter line: `lora, 1,234 trainable of 135,000 parameters; attention ...`."""
        return (f"{self.kind}, {self.trainable_params:,} trainable of {self.total_params:,} parameters"
                f"{self.describe_groups()}")

    def describe_groups(self) -> str:
        """`; attention 25,600 (LoRA 1,024), experts 196,608 (LoRA 16,384), router 512 (frozen)`, or ''."""
        parts = []
        for name, counts in self.groups.items():
            if not counts.get("adapted"):
                how = "frozen"
            elif self.kind == "none" or name == "router":
                how = "trained in full" if counts["adapted"] >= counts["params"] else f"{counts['trainable']:,} trained"
            else:
                how = f"{self.kind} {counts['trainable']:,}"
            parts.append(f"{name} {counts['params']:,} ({how})")
        return "; " + ", ".join(parts) if parts else ""


@runtime_checkable
class ModelHandle(Protocol):
    """A loaded model with its tokenizer; opaque to pipelines beyond these fields."""

    model: Any
    tokenizer: Any
    source: str                # where the weights came from (resolved path)

    def describe(self) -> str:
        """How the weights were loaded, for the run log: the path they took, the storage dtype and the
        attention implementation chosen for the family."""


class ArrayOps(Protocol):
    """Array operations on the backend's native arrays (torch tensors, mx arrays).

    Training objectives (`training/preference.py`, `training/reward.py`) are
    written once with these and Python's arithmetic operators, which both
    runtimes overload; no objective imports torch or mlx.
    """

    def from_numpy(self, array: "np.ndarray") -> Any: ...
    def to_numpy(self, x: Any) -> "np.ndarray": ...
    def to_float(self, x: Any) -> float: ...
    def detach(self, x: Any) -> Any: ...
    def log_sigmoid(self, x: Any) -> Any: ...
    def sigmoid(self, x: Any) -> Any: ...
    def softplus(self, x: Any) -> Any: ...
    def exp(self, x: Any) -> Any: ...
    def expm1(self, x: Any) -> Any: ...
    def log(self, x: Any) -> Any: ...
    def log1p(self, x: Any) -> Any: ...
    def log_softmax(self, x: Any) -> Any:
        """Over the last axis."""
    def pick(self, x: Any, index: "np.ndarray") -> Any:
        """x[i, index[i]] for a 2-D x: one entry per row."""
    def take(self, x: Any, index: "np.ndarray") -> Any:
        """x[index] along the first axis."""
    def relu(self, x: Any) -> Any: ...
    def clip(self, x: Any, low: float | None = None, high: float | None = None) -> Any: ...
    def where(self, cond: Any, a: Any, b: Any) -> Any: ...
    def concat(self, xs: list[Any]) -> Any: ...
    def stack(self, xs: list[Any]) -> Any: ...
    def sum(self, x: Any) -> Any: ...
    def mean(self, x: Any) -> Any: ...
    def minimum(self, a: Any, b: Any) -> Any:
        """Elementwise."""
    def row_sum(self, x: Any, rows: "np.ndarray", n: int) -> Any:
        """Sums of a 1-D x per row: out[r] = sum of x[i] where rows[i] == r, for r < n (float32)."""


class Objective(Protocol):
    """What a training step minimises, written once against `ArrayOps` (see `training/`).

    The trainer divides each micro-batch's summed loss by the summed `count`
    of the whole step (tokens for SFT, pairs for DPO, ...), so accumulating
    micro-batches gives the gradient of one large batch.
    """

    def count(self, batch: Any) -> int:
        """How many units (tokens, pairs, examples, steps) the batch's loss is summed over."""

    def __call__(self, handle: "ModelHandle", batch: Any) -> tuple[Any, dict[str, float]]:
        """(summed loss as a native scalar with gradient, metrics averaged over the batch).

        The trainer calls it so; evaluation calls it with grad=False as well."""


@runtime_checkable
class TrainerProtocol(Protocol):
    """Owns the optimizer state for one model. The pipeline owns the schedule."""

    def step(self, micro_batches: list[Any], lr: float, objective: Objective | None = None) -> StepResult:
        """Forward and backward over each micro-batch, then one optimizer update.

        Without an objective, the loss is SFT's: token cross-entropy over labels != -100."""

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state and RNG state, enough to continue exactly."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def release(self) -> None:
        """After the run's last step and checkpoint: drop the optimizer state and the gradients and give the
        device's cached memory back, so what follows training (held-out evaluation, the merge) has the memory
        they held. The trainer takes no step after it."""


class Decoder(Protocol):
    """Continuous batching for one loaded model (`BackendProtocol.open_decoder`): sequences join and
    leave between steps, and each step decodes one token for every sequence in one batch.

    A sequence computes what it would alone: greedy decoding gives `generate`'s ids (up to the
    rounding of a padded batch), sampling draws from a random state of its own, seeded by
    `seed`, so its ids do not depend on what else is in the batch. Stop tokens, lengths and
    deadlines are the caller's business: a sequence runs until `remove`.
    One thread owns a decoder."""

    def add(self, prompt: list[int], sampling: "Sampling | None", seed: int) -> int:
        """Prefill `prompt` (at least one token); returns the sequence's slot. Its first token
        comes from the next `step`. `sampling` None is greedy."""

    def step(self) -> dict[int, int]:
        """One new token for every sequence added and not removed: {slot: token id}. A sequence whose
        token cannot be drawn (its scores NaN or infinite) is removed and left out; `failures` says why."""

    def failures(self) -> dict[int, Exception]:
        """{slot: error} for the sequences `step` removed since the last call; the others went on."""

    def remove(self, slot: int) -> None:
        """Drop a sequence (finished, cancelled); its memory is freed before the next step."""

    def batch_sizes(self) -> dict[int, int]:
        """How many steps decoded how many sequences at once: {batch size: steps}."""

    def close(self) -> None: ...


class GptqPlan(Protocol):
    """A backend's GPTQ at one config's `gptq` settings (`BackendProtocol.plan_gptq`), for `method: gptq`
    (training/gptq.py): check the model, measure the round-to-nearest baseline, quantize and save."""

    description: str     # what will run, for the log: bits, groups, grid, and whose GPTQ
    label: str           # the quantized model's name in the held-out comparison ("GPTQ")

    def check(self, handle: ModelHandle) -> None:
        """Refuse what the loaded model cannot take (module names, layer shapes), all named at once, before
        anything is written."""

    def round_to_nearest(self, handle: ModelHandle) -> None:
        """Replace the weights GPTQ would quantize by round-to-nearest on the same grid, in place: the
        baseline GPTQ is measured against. The handle is fit for evaluation only afterwards."""

    def quantize(self, handle: ModelHandle, model_cfg: "ModelConfig", examples: list["np.ndarray"], out: "Path",
                 echo: Callable[[str], Any]) -> dict[str, Any]:
        """GPTQ of the model `handle` was loaded from (`model_cfg`), from its weights as loaded (read again
        where `round_to_nearest` changed them), calibrated on `examples` (token ids, no padding entering a
        Hessian); saved in `out` with the handle's tokenizer. The handle's model is released. Returns this
        backend's own keys of run_summary.json (its format, its report)."""


class PreparedQat(Protocol):
    """The layers `QatPlan.prepare` made fake-quantize."""

    def names(self) -> list[str]: ...

    def describe(self) -> str:
        """The log line: the grid and how many layers fake-quantize, by how."""


class QatPlan(Protocol):
    """A backend's quantization-aware training at one config's `qat` settings (`BackendProtocol.plan_qat`),
    for `method: qat` (training/qat.py): a prepare/convert pair around SFT's loop."""

    description: str     # the grid, for the log: "int4 weights (groups of 32, symmetric)"

    def check_adapter(self, adapter_cfg: "AdapterConfig") -> None:
        """Refuse an adapter QAT cannot train through (before anything loads)."""

    def check_model(self, model_cfg: "ModelConfig") -> None:
        """Refuse settings the model's layers cannot take (a group size that does not divide an input
        width), from its config alone, before its weights load."""

    def prepare(self, handle: ModelHandle) -> PreparedQat:
        """Every linear layer but the output head fake-quantizes, in place (after attach_adapter, before
        create_trainer); fake quantization starts off."""

    def set_fake_quant(self, handle: ModelHandle, enabled: bool) -> None:
        """Switch every fake quantizer `prepare` added on or off."""

    def convert(self, handle: ModelHandle, prepared: PreparedQat, out: "Path") -> int:
        """Replace the handle's model by the converted one (integer codes and scales, an adapter merged in
        first) and save it in `out` with the tokenizer; returns the bytes of its tensors."""


@runtime_checkable
class BackendProtocol(Protocol):
    name: str
    device: str

    ops: ArrayOps

    # -- what this runtime can do, for recipes and tools that must not branch on its name
    adapter_layouts: tuple[str, ...]    # adapter directories load_adapter reads as they are: "peft", "mlx"
    transformers_model: bool            # handle.model is a transformers PreTrainedModel (lm-eval drives it)

    # -- models
    def load_model(self, model_cfg: "ModelConfig", precision: str = "auto", head: str | None = None,
                   adapter: "AdapterConfig | None" = None) -> ModelHandle:
        """A causal LM, or with `head` a scalar-head model: "sequence_classification" (one score
        per sequence, read at its last token, as transformers does) or "token_classification"
        (two classes per token: for process reward models).

        Weights arrive at their storage precision (`model_cfg.dtype`, auto: the compute dtype
        for a frozen base, fp32 for weights that train in full), never as a full fp32 copy
        first. With `adapter` the base is loaded for that adapter: for QLoRA it comes back
        already quantized, each layer as its weights were read."""

    def save_model(self, handle: ModelHandle, path: str) -> None: ...

    # -- adapters
    def attach_adapter(self, handle: ModelHandle, adapter_cfg: "AdapterConfig",
                       batches: "list[Batch] | None" = None) -> AdapterInfo:
        """The adapter on the loaded model; `batches` (the run's training batches) are what adapter.init eva
        decomposes, None for every other initialisation."""

    def quantize_base(self, handle: ModelHandle, adapter_cfg: "AdapterConfig") -> Any:
        """Replace the base's linear layers by frozen 4-bit ones (QLoRA); returns a report."""

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

    def sequence_logprobs(self, handle: ModelHandle, batch: "Batch", grad: bool = True,
                          router_aux: bool = False) -> tuple[Any, ...]:
        """(summed log p(target) per row [B] as a native array, loss-carrying tokens per row [B]).

        The same masking as SFT: positions with label != -100. With `grad` the
        result carries gradient to the trainable weights. With `router_aux` a third item: the
        mixture-of-experts router's weighted load-balancing loss of the same forward, a native
        scalar (zero where the run adds none: routing.py), which training objectives add."""

    def reference_logprobs(self, handle: ModelHandle, batch: "Batch") -> Any:
        """Summed log-probs per row [B] under the reference: the model with its adapter switched
        off (no second copy of the weights), or the model as it is when it has no adapter.
        No gradient."""

    def sequence_scores(self, handle: ModelHandle, batch: "Batch", grad: bool = True) -> Any:
        """A sequence_classification model's score per row [B], native, read where transformers
        reads it (the last non-padding token)."""

    def token_scores(self, handle: ModelHandle, batch: "Batch", grad: bool = True) -> Any:
        """A token_classification model's logits [N, classes] at the positions where
        batch.labels != -100 (labels not shifted: each marks its own token), in row-major order."""

    def logits(self, handle: ModelHandle, batch: "Batch") -> "np.ndarray":
        """Float32 logits [batch, time, vocab]; for tests and parity checks."""

    def generate(
        self, handle: ModelHandle, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]
    ) -> list[list[int]]:
        """Greedy continuation token ids for each prompt (without the prompt or the stop token)."""

    def sample(
        self, handle: ModelHandle, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
        sampling: Sampling, seed: int | list[int],
    ) -> list[list[int]]:
        """Sampled continuation ids for each prompt (without the prompt), batched with a KV cache.

        A row ends after its first stop token, which is kept (it is what a model learns to
        stop with), or after `max_new_tokens` tokens. The draw depends on `seed` alone: the
        same prompts, weights and seed give the same ids, and the runtime's global random
        state (dropout's) is left as it was. Eval mode (no dropout) while sampling.
        `seed` may be a list, one per row: the rows sharing a seed draw from a stream of their
        own, so their ids do not depend on the rest of the batch, and are the ids those rows
        would get with that seed as an int."""

    def stream(
        self, handle: ModelHandle, prompt: list[int], max_new_tokens: int, stop_ids: list[int],
        sampling: Sampling | None, seed: int, on_token: Callable[[int], bool],
    ) -> None:
        """Generate for one prompt, handing each new id to `on_token` as soon as it exists (the stop token
        included); `on_token` returns False to end early. Greedy (`sampling` None) produces the ids
        `generate` returns, sampled the ids `sample` returns for the same seed."""

    def open_decoder(self, handle: ModelHandle) -> Decoder:
        """A continuous-batching decoder over `handle` (for `mudpuppy serve`): see `Decoder`."""

    def token_logprobs(
        self, handle: ModelHandle, batch: "Batch", grad: bool = True, temperature: float = 1.0,
        reference: bool = False, entropy: bool = False, router_aux: bool = False,
    ) -> tuple[Any, ...]:
        """(log p(target) at every position whose label is not -100, row-major [N] float32 native;
        the entropy of the distribution there [N] as numpy, when `entropy`, else None); with
        `router_aux` a third item, as sequence_logprobs'.

        The logits are divided by `temperature` first, as when the tokens were sampled. Only
        those positions go through the output head, a chunk at a time, so [N, vocab] logits
        are never held at once, with gradient or without. With `reference`, the model with
        its adapter switched off, without gradient (as reference_logprobs). Without `grad`:
        eval mode, no graph."""

    def token_divergence(
        self, handle: ModelHandle, teacher: ModelHandle, batch: "Batch", divergence: Callable[[Any, Any], Any],
        grad: bool = True, temperature: float = 1.0, top_k: int = 0,
    ) -> Any:
        """Distillation's loss, a native float32 scalar: the [chunk, V] terms `divergence(student, teacher)`
        returns, summed over the vocabulary and then over chunks of the positions whose label is not -100
        (the vocabulary first: float32 digits), each argument [chunk, V] log-probabilities of that
        model's logits / `temperature` (with `top_k`, [chunk, k + 1]: the teacher's k likeliest tokens and
        one bucket for the rest of the mass, in both). `teacher` is a second causal LM of the same
        vocabulary from load_model; it runs without gradient, in eval mode. Each model's decoder runs once
        and its head a chunk of positions at a time, so neither model's [N, vocab] logits are held at
        once, with gradient or without. With `grad` the result carries gradient to the student's
        trainable weights; without, eval mode and no graph."""

    def seed(self, seed: int) -> None: ...

    def host_backend(self) -> "BackendProtocol":
        """This runtime on the host's own memory, for work that needs no accelerator and would not fit beside
        a live run on it (the merge at the end of training loads the base again in fp32): itself where the
        device is host memory (torch on a CPU, MLX's unified memory)."""

    def input_squares(self, handle: ModelHandle, sequences: list[list[int]]) -> dict[str, tuple["np.ndarray", int]]:
        """What llama-imatrix collects: for every linear layer (by module name), the float64 sum over all
        token rows of each input column's square, and the rows seen; no padded position counts, and each
        sequence's rows are what they are when it runs alone."""

    def memory_peaks(self) -> dict[str, int] | None:
        """The device's peak memory in bytes since the previous call ("allocated": what tensors held;
        "reserved": what the allocator held, where it says), starting a new window; None where the
        runtime keeps no such count (torch on a CPU: the process's RSS is the number there)."""

    # -- quantization recipes
    def plan_gptq(self, gptq_cfg: "GptqConfig") -> GptqPlan:
        """This backend's GPTQ at these settings. Refuses, before anything loads, every setting it cannot
        honour (one MudpuppyError naming them all and the backend that can), or GPTQ altogether."""

    def plan_qat(self, qat_cfg: "QatConfig") -> QatPlan:
        """This backend's quantization-aware training at these settings; a backend without fake
        quantization refuses (MudpuppyError naming the backends that have it)."""
