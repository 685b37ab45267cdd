"""The method sections: `preference`, `reward`, `grpo`, `rloo`, `online_dpo`, `distill`, `gptq` and `qat`, each read
under its own method only (RunConfig fills in or refuses them). Whether the online methods' reward specs,
tools and environment name something usable is the check step's (`mudpuppy.configure`): their syntax lives
in `rewards/`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from .base import _Strict, outside_check
from .training import TrainingConfig


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


class SamplingConfig(_Strict):
    """What every online method shares (`grpo`, `rloo`, `online_dpo`): sampling, rewards and tools.
    Names and defaults as TRL 1.x's GRPOConfig, so configs move over. See docs/methods.md."""

    num_generations: int = Field(8, ge=2, description="completions sampled per prompt (a group)")
    max_completion_length: int = Field(256, gt=0, description="tokens sampled at most per completion")
    temperature: float = Field(1.0, gt=0, description="sampling temperature; the log-probs use it too")
    top_p: float = Field(1.0, gt=0, le=1.0)
    top_k: int = Field(0, ge=0, description="0: no top-k cut")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    beta: float = Field(0.0, ge=0.0, description="weight of the KL to the reference (k3); 0 computes no reference")
    steps_per_generation: int | None = Field(
        None, gt=0, description="micro-batches each generation batch is split into; null: gradient_accumulation_steps")
    mask_truncated_completions: bool = Field(False, description="completions cut at max_completion_length carry no loss")
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
    def _rewards(self, info: ValidationInfo):
        outside_check(info, "grpo.tools", self)          # tools and environment name 'file.py:function's
        if not self.reward_funcs:
            if self.environment is None:
                raise ValueError("reward_funcs: name one or more reward functions (or an environment whose "
                                 "get_reward() scores each rollout)")
            if self.reward_weights:
                raise ValueError("reward_weights: there are no reward_funcs to weight (the environment's "
                                 "get_reward() has weight 1)")
            return self
        outside_check(info, "grpo.reward_funcs", self)   # raises ValueError naming the entry
        return self


class RolloutConfig(SamplingConfig):
    """The policy-gradient methods' (`grpo`, `rloo`): a clipped importance ratio, several passes."""

    epsilon: float = Field(0.2, gt=0, description="clipping: the ratio is kept within [1-epsilon, 1+epsilon_high]")
    epsilon_high: float | None = Field(
        None, gt=0, description="upper clip; null: epsilon. cispo: the cap on the ratio itself (ScaleRL's "
                                "epsilon_max, 5.0 recommended; null caps at epsilon, as in TRL)")
    num_iterations: int = Field(1, gt=0, description="optimisation passes over each generation batch")

    @property
    def epsilon_upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class GrpoConfig(RolloutConfig):
    """`method: grpo`: online RL with group-relative advantages. See docs/methods.md."""

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
    importance_sampling_level: Literal["token", "sequence"] = "token"
    use_bias_correction_kl: bool = Field(
        True, description="beta > 0: the KL term is weighted by the importance ratio (TRL's default)")


class RlooConfig(RolloutConfig):
    """`method: rloo`: REINFORCE leave-one-out, TRL 1.16's RLOOTrainer: each completion's advantage is its
    reward minus the mean reward of the other completions of its prompt; a sequence-level clipped ratio;
    the KL to the reference is subtracted from the reward. See docs/methods.md."""

    num_generations: int = Field(2, ge=2, description="completions sampled per prompt (the leave-one-out group)")
    beta: float = Field(0.05, ge=0.0, description="weight of the KL to the reference, subtracted from each "
                                                 "completion's reward (sum over its tokens of logp - ref logp); "
                                                 "0 computes no reference")
    epsilon_high: float | None = Field(None, gt=0, description="upper clip; null: epsilon")
    normalize_advantages: bool = Field(False, description="scale the generation batch's advantages to mean 0, "
                                                          "std 1")
    reward_clip_range: tuple[float, float] | None = Field(
        None, description="[min, max]: each completion's weighted reward clipped to it (before the KL); null: "
                          "no clipping")

    @field_validator("reward_clip_range")
    @classmethod
    def _clip_range(cls, v):
        if v is not None and not v[0] < v[1]:
            raise ValueError(f"[{v[0]:g}, {v[1]:g}] is empty; give [min, max] with min < max")
        return v


class OnlineDpoConfig(SamplingConfig):
    """`method: online_dpo`: TRL 1.16's experimental OnlineDPOTrainer. Two completions a prompt, the one
    the rewards score higher (the first on a tie) chosen, DPO's loss on the pair. See docs/methods.md."""

    num_generations: Literal[2] = Field(2, description="completions per prompt: a pair, always 2")
    temperature: float = Field(0.9, gt=0, description="sampling temperature (the loss's log-probs are at 1, as "
                                                      "TRL's)")
    max_completion_length: int = Field(64, gt=0, description="tokens sampled at most per completion")
    beta: float = Field(0.1, gt=0, description="DPO's beta: how strongly the policy is held to the reference")
    loss_type: Literal["sigmoid", "ipo"] = Field("sigmoid", description="sigmoid: DPO's loss; ipo: IPO's, on "
                                                                        "summed log-ratios")
    missing_eos_penalty: float | None = Field(
        None, description="subtracted from the reward of a completion cut at max_completion_length; null: none")


class DistillConfig(_Strict):
    """`method: distill`: knowledge distillation from a frozen teacher sharing the student's tokenizer, GKD's
    mix of off-policy (the data's completions) and on-policy (the student's samples) micro-batches, and TRL
    1.16's divergences. See docs/methods.md#distillation."""

    teacher: str = Field(min_length=1, description="the teacher: HF directory, hub id or alias, any family "
                                                    "mudpuppy loads, with the student's vocabulary")
    teacher_revision: str | None = Field(None, description="hub revision of the teacher")
    teacher_quantize: bool = Field(False, description="load the teacher's linear layers as 4-bit codes (QLoRA's "
                                                      "int4 groups of 64) instead of at its storage precision")
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = Field(
        "jsd", description="forward_kl: KL(teacher || student); reverse_kl: KL(student || teacher); jsd: the "
                           "generalized Jensen-Shannon divergence at beta")
    beta: float = Field(0.5, gt=0.0, lt=1.0, description="jsd: the mixture's teacher weight (TRL's beta; "
                                                          "forward_kl is beta 0, reverse_kl beta 1)")
    temperature: float = Field(0.9, gt=0, description="divides both models' logits in the loss, and the "
                                                       "student's when it samples")
    top_k: int = Field(0, ge=0, description="0: the teacher's whole vocabulary; k: its k likeliest tokens and "
                                            "one bucket for the rest (TRL's tail bucket)")
    lmbda: float = Field(0.5, ge=0.0, le=1.0, description="share of micro-batches on-policy (GKD's lmbda): "
                                                          "the student continues the prompt, the teacher scores")
    max_completion_length: int = Field(128, gt=0, description="on-policy: tokens sampled at most per completion")

    @property
    def trl_beta(self) -> float:
        """TRL's beta for this loss: 0 forward KL, 1 reverse KL, else the JSD's mixture weight."""
        return {"forward_kl": 0.0, "reverse_kl": 1.0}.get(self.loss, self.beta)


def power_of_two_group(v: int) -> int:
    """GPTQ's and QAT's group_size: columns sharing one scale, a power of two, or -1 for one per row."""
    if v != -1 and (v <= 0 or v & (v - 1)):
        raise ValueError("group_size: a power of two (32, 64, 128, ...) or -1 for one group per row")
    return v


GroupSize = Annotated[int, AfterValidator(power_of_two_group)]


class GptqConfig(_Strict):
    """`method: gptq`: post-training quantization (no optimizer), calibrated on the config's data.
    Names as AutoGPTQ / transformers' GPTQConfig, so configs move over. See docs/quantization.md."""

    bits: Literal[2, 3, 4, 8] = 4
    group_size: GroupSize = Field(128, description="columns sharing one scale and zero; -1: one per output row")
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


class QatConfig(_Strict):
    """`method: qat`: fine-tuning with fake-quantized weights (and optionally activations), converted at the
    end to a model with real low-bit weights. See docs/quantization.md."""

    weight_bits: Literal[4, 8] = 4
    group_size: GroupSize = Field(32, description="weight columns sharing one scale; -1: one per output row")
    activations: Literal["none", "int8"] = Field("none", description="int8: dynamic per-token fake quantization "
                                                                     "of the linear layers' inputs")
    fake_quant_after_n_steps: int | None = Field(
        None, ge=0, description="train this many steps in full precision before fake quantization starts")


def grpo_batch_problems(grpo: SamplingConfig, training: TrainingConfig, section: str = "grpo") -> list[str]:
    """A generation batch (micro_batch_size x steps_per_generation completions) must hold whole groups."""
    steps = grpo.steps_per_generation or training.gradient_accumulation_steps
    size = training.micro_batch_size * steps
    if size % grpo.num_generations:
        return [f"{section}.num_generations: a generation batch holds training.micro_batch_size x steps_per_generation = "
                f"{training.micro_batch_size} x {steps} = {size} completions, which is not a whole number of groups "
                f"of {grpo.num_generations}; make it a multiple (for example micro_batch_size: {grpo.num_generations})"]
    if section == "online_dpo" and training.micro_batch_size % 2:
        return [f"training.micro_batch_size: online_dpo trains on pairs, both in one micro-batch; "
                f"{training.micro_batch_size} completions split a pair (make it even)"]
    return []

