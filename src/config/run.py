"""The root of a run's config: `RunConfig` holds every section, fills in the one its method reads, refuses
the others, and checks what only the sections together can say."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import _Strict
from .data import DataConfig
from .methods import (DistillConfig, GptqConfig, GrpoConfig, OnlineDpoConfig, PreferenceConfig, QatConfig,
                      RewardConfig, RlooConfig, grpo_batch_problems)
from .model import AdapterConfig, ModelConfig, eva_method_problem, residual_reference_problem
from .training import DistributedConfig, EvalConfig, LoggingConfig, MemoryConfig, TrainingConfig, loraplus_problem

BACKEND_NAMES = ("auto", "cpu", "cuda", "rocm", "mlx")
# The methods on GRPO's rollout machinery, each with a section of its name.
ONLINE = ("grpo", "rloo", "online_dpo")


class RunConfig(_Strict):
    model: ModelConfig
    backend: Literal[BACKEND_NAMES] = "auto"  # type: ignore[valid-type]
    devices: list[int] | None = Field(None, description="GPU indices (after *_VISIBLE_DEVICES); default: the first usable")
    method: Literal["sft", "preference", "rm", "prm", "grpo", "rloo", "online_dpo", "distill", "gptq",
                    "qat"] = "sft"
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
    rloo: RlooConfig | None = Field(None, description="method: rloo only (reward_funcs is required there)")
    online_dpo: OnlineDpoConfig | None = Field(None, description="method: online_dpo only (reward_funcs is "
                                                                 "required there)")
    distill: DistillConfig | None = Field(None, description="method: distill only (distill.teacher is required "
                                                            "there)")
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
        for name in ONLINE:
            section = getattr(self, name)
            if self.method != name:
                if section is not None:
                    problems.append(f"{name}: this section applies to method: {name} (this config has method: "
                                    f"{self.method})")
            elif section is None:
                problems.append(f"{name}: method {name} needs a {name} section with at least {name}.reward_funcs "
                                f"(for example: {name}: {{reward_funcs: [exact_match]}})")
            else:
                problems += grpo_batch_problems(section, self.training, name)
                if section.beta > 0 and self.adapter.type == "none":
                    # The reference is the base with the adapter switched off; full fine-tuning
                    # has no such switch, and a frozen copy would double the model's memory.
                    fix = "use an adapter" if name == "online_dpo" else f"with adapter.type none set {name}.beta: 0"
                    problems.append(f"{name}.beta: a KL to the reference needs an adapter (the reference is the "
                                    f"base with the adapter off); {fix}")
        if self.method == "distill" and self.distill is None:
            problems.append("distill: method distill needs a distill section naming the teacher (for example: "
                            "distill: {teacher: HuggingFaceTB/SmolLM2-360M-Instruct})")
        elif self.method != "distill" and self.distill is not None:
            problems.append(f"distill: this section applies to method: distill (this config has method: {self.method})")
        for name, section in (("gptq", GptqConfig), ("qat", QatConfig)):
            if self.method == name:
                if getattr(self, name) is None:
                    setattr(self, name, section())
            elif getattr(self, name) is not None:
                problems.append(f"{name}: this section applies to method: {name} (this config has method: {self.method})")
        if self.method in ("preference", "rm", "prm", "distill", *ONLINE) and self.data.packing:
            problems.append(f"data.packing: packing is for sft; method {self.method} batches whole sequences "
                            "(set it to false)")
        pref = self.preference if self.method == "preference" else None
        if pref is not None and pref.needs_reference and self.adapter.type == "none" and not pref.precompute_ref:
            # With an adapter the reference is the base with the adapter switched off; full
            # fine-tuning has no such switch, and a frozen copy would double the model's memory.
            problems.append(f"preference.precompute_ref: {pref.type} needs reference log-probs; with adapter.type none set "
                            "preference.precompute_ref: true (computed once from the untrained weights)")
        if pref is not None and pref.needs_reference and (ref := residual_reference_problem(
                self.adapter, f"preference.type {pref.type}", "use simpo or orpo (no reference), or adapter.init default")):
            problems.append(ref)
        online = self.rollout
        if online is not None and online.beta > 0 and (ref := residual_reference_problem(
                self.adapter, f"{self.method}.beta", f"set {self.method}.beta: 0 or adapter.init default")):
            problems.append(ref)
        if (loraplus := loraplus_problem(self.training, self.adapter.type)) is not None:
            problems.append(loraplus)
        if (eva := eva_method_problem(self.adapter, self.method)) is not None:
            problems.append(eva)
        if self.training.precision == "fp8" and (fp8 := fp8_problem(self.adapter.type, self.memory.stream_layers)):
            problems.append(fp8)
        if self.memory.stream_layers and self.adapter.type == "none":
            problems.append("memory.stream_layers: streaming moves frozen base layers; with adapter.type none every "
                            "weight trains (use lora/qlora, or memory.optimizer_offload for full fine-tuning)")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def rollout(self) -> GrpoConfig | RlooConfig | OnlineDpoConfig | None:
        """The online method's section (grpo, rloo, online_dpo: sampling, rewards, tools), None for the others."""
        return getattr(self, self.method) if self.method in ONLINE else None

    def data_method(self) -> str:
        """The name the data layer checks formats against (data.METHOD_FORMATS): dpo, kto, rm, ..."""
        if self.method in ONLINE:
            return "grpo"             # every online method samples from GRPO's rl prompts
        if self.method == "preference":
            return self.preference.type
        if self.method in ("gptq", "qat", "distill"):
            return "sft"              # calibration / training examples / distillation's completions are SFT data
        return self.method

    def resolve_path(self, path: str) -> Path:
        """A data path as the user meant it: config directory first, then cwd."""
        return resolve_relative(path, self.source_dir)

    def backend_options(self) -> dict[str, Any]:
        """What `create_backend` needs from the config besides the name."""
        return {"devices": self.devices, "precision": self.training.precision, "memory": self.memory,
                "optimizer": self.training.optimizer, "distributed": self.distributed,
                "deterministic": self.training.deterministic}

    def dump(self) -> dict[str, Any]:
        """Every key with its value, as a run's config.yaml records it; loading the dump gives this config."""
        dumped = self.model_dump(mode="json", exclude={"source_dir"})
        if self.adapter.quant_backend == "mxfp4":        # a group size given with mxfp4 is refused on load
            dumped["adapter"].pop("quant_group_size", None)
        return dumped


def fp8_problem(adapter_type: str | None, stream_layers: bool) -> str | None:
    """Why precision fp8 cannot train this run, or None: fp8 trains the base's plain linear layers with
    torchao's float8 matmuls, and QLoRA's 4-bit layers and streamed layers are frozen layers it cannot take
    (torchao would swap them and assign their read-only weight). The config refuses the pair; the torch
    backend asks again for a model loaded from Python with its own adapter and memory settings."""
    held = ("adapter.type: qlora keeps them as 4-bit codes" if adapter_type == "qlora"
            else "memory.stream_layers keeps them in host memory" if stream_layers else None)
    if held is None:
        return None
    return (f"training.precision: fp8 runs the base's linear layers as float8 matmuls, but {held}; "
            "use precision bf16 for this run, or fp8 with adapter lora / full fine-tuning and without "
            "memory.stream_layers")


def resolve_relative(path: str, source_dir: str | None) -> Path:
    p = Path(os.path.expanduser(path))
    if p.is_absolute():
        return p
    if source_dir is not None:
        beside = Path(source_dir) / p
        if beside.exists() or not p.exists():
            return beside
    return p

