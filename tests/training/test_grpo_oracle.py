"""Our GRPO maths against TRL 1.16's GRPOTrainer: loss, gradients, metrics, log-probs and advantages.

The oracle is TRL's own trainer, built on the tiny model with a LoRA config
(its LoRA weights randomised, so the policy differs from the reference and
every gradient is non-zero):

- the loss: TRL's `_compute_loss` on a batch we build (prompts, completions of
  different lengths, advantages of both signs, old and reference log-probs
  perturbed so that the ratio clips on both sides), then our GrpoObjective on
  the very same PEFT model; value, every LoRA gradient and the logged metrics;
- the per-token log-probs and entropies: TRL's `_get_per_token_logps_and_entropies`;
- the advantages: TRL's real `_generate_and_score_completions` (it generates
  with the tiny model, then scores with reward functions that ignore the
  completions and return a fixed table, None included), read back from the
  trainer's logs;
- the generation-batch normaliser of dapo, cispo and vespo when a generation
  batch is split over several steps (steps_per_generation >
  gradient_accumulation_steps), with the micro-batches cut by TRL's own
  `split_tensor_dict`.

All eight of TRL's loss types are checked, each at token and at sequence level
(TRL refuses no combination; it only warns about some).

How the trainer uses the objective (TorchTrainer._step): each micro-batch's
summed loss is divided by the step's summed `objective.count`. With one
micro-batch a step, our loss is total / count(batch): that is what TRL's
`_compute_loss` returns.

All prompts have the same length: TRL left-pads prompts, we put prompt and
completion contiguously with positions from 0; with equal prompt lengths the
two layouts are the same tokens at the same positions.

Tolerance: 1e-5 absolute, fp32, for values, gradients and metrics.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mudpuppy import create_backend
from mudpuppy.backends.torch.backend import TorchModel
from mudpuppy.config import GrpoConfig
from mudpuppy.training.grpo_loss import GrpoObjective, RolloutBatch, group_advantages
from mudpuppy.training.rollout import completion_batch

from .test_preference_oracle import assert_grads_match, lora_grads, randomise_lora

TOL = 1e-5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IGNORE_INDEX = -100
pytest.importorskip("trl")

PROMPT_LEN = 5
# Six completions of different lengths (the longest, 6, is below max_completion_length, so
# dr_grpo's divisor is the config's value, not the padded width).
LENGTHS = [5, 2, 6, 3, 4, 1]
MAX_COMPLETION = 8
ADVANTAGES = [1.2, -0.9, 0.6, -1.3, 0.8, -0.4]
# Per-row shift of the old log-probs: ratio = exp(logp - old) = exp(-shift). Row 2 (advantage > 0,
# ratio ~1.42) clips high, row 3 (advantage < 0, ratio ~0.70) clips low, rows 0 and 1 sit outside
# the range on the side where the unclipped term wins, rows 4 and 5 near 1: a mix at token and
# at sequence level.
ROW_SHIFT = [0.35, -0.35, -0.35, 0.35, 0.0, 0.0]
NUM_GENERATIONS = 3
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")   # PPO's clipped ratio, and its clip_ratio metrics
# cispo caps the ratio itself at epsilon_high: 0.28 (the others' value) would cap every ratio here
# (all near 1) to one constant; 1.2 caps the high ones only.
CISPO_CAP = 1.2
# Logged by TRL, not by ours (the extreme per-completion clip ratios across ranks).
NOT_LOGGED = {"clip_ratio/low_min", "clip_ratio/high_max"}
# TRL 1.16 multiplies the per-token KL by the importance ratio coef_1 by default
# (GRPOConfig.use_bias_correction_kl=True): same value on-policy, a different gradient always.
# Ours adds the plain k3 KL, i.e. TRL with use_bias_correction_kl=False, unless our GrpoConfig
# grows TRL's field; the main matrix pins TRL's flag to False, and
# test_kl_with_bias_correction_matches_trl checks TRL's default.
HAS_BIAS_CORRECTION = "use_bias_correction_kl" in GrpoConfig.model_fields


@pytest.fixture(scope="module")
def backend():
    return create_backend("cpu")


# --------------------------------------------------------------------------- helpers

def val(x: torch.Tensor) -> float:
    return float(x.detach())


def report(name: str, diffs: dict[str, float]) -> None:
    """Shown with `pytest -s`: the measured agreement, for the notes."""
    print(f"\n{name}: " + ", ".join(f"|{k} - oracle| {v:.1e}" for k, v in diffs.items()))


def grpo_trainer(tiny_model_dir, reward_funcs=None, dataset_rows=None, kind="GRPO", **config):
    """A real GRPOTrainer (kind "RLOO": RLOOTrainer) on the tiny model with a LoRA adapter (randomised),
    in train mode."""
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    args = getattr(trl, f"{kind}Config")(output_dir=str(tiny_model_dir.parent / f"trl-{kind.lower()}-out"),
                                         report_to="none", bf16=False, gradient_checkpointing=False, use_cpu=True,
                                         **config)
    funcs = reward_funcs or [lambda completions, **kw: [0.0] * len(completions)]
    rows = dataset_rows or [{"prompt": "hello"}] * args.per_device_train_batch_size
    trainer = getattr(trl, f"{kind}Trainer")(
        model=base, reward_funcs=funcs, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, task_type="CAUSAL_LM"))
    randomise_lora(trainer.model)
    trainer.model.train()
    # Set by Trainer's training loop (len of the step's micro-batches) before any compute_loss.
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return trainer, tok


def make_case(tok, lengths, seed: int = 0):
    """Equal-length prompts, completions of `lengths` tokens: ours as lists, TRL's as padded tensors."""
    rng = np.random.default_rng(seed)
    low = max(tok.all_special_ids) + 1                     # ordinary tokens only
    prompts = [rng.integers(low, len(tok), PROMPT_LEN).tolist() for _ in lengths]
    completions = [rng.integers(low, len(tok), n).tolist() for n in lengths]
    width = max(lengths)
    completion_ids = torch.full((len(lengths), width), tok.pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for i, c in enumerate(completions):
        completion_ids[i, : len(c)] = torch.as_tensor(c)
        completion_mask[i, : len(c)] = 1
    return prompts, completions, {"prompt_ids": torch.as_tensor(prompts),
                                  "prompt_mask": torch.ones((len(lengths), PROMPT_LEN), dtype=torch.long),
                                  "completion_ids": completion_ids, "completion_mask": completion_mask}


def trl_logps(trainer, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's per-token log-probs and entropies [B, T] of the trainer's model (at its temperature)."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, input_ids, attention_mask, inputs["completion_ids"].size(1), compute_entropy=True)
    return logps, entropies


def perturbed(logps: torch.Tensor, mask: torch.Tensor, row_shift, token_scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    noise = torch.as_tensor(row_shift, dtype=torch.float32)[:, None] + token_scale * torch.randn(logps.shape,
                                                                                                 generator=g)
    return (logps + noise) * mask


def flat(x: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    """TRL's [B, T] values at mask == 1, row-major: our flat token layout."""
    return x.detach()[mask.bool()].numpy().astype(np.float32)


def our_config(loss_type, level, beta, delta=None, temperature=0.9, bias_correction_kl=False, epsilon_high=0.28,
               **loss_args) -> GrpoConfig:
    extra = {"use_bias_correction_kl": bias_correction_kl} if HAS_BIAS_CORRECTION else {}
    return GrpoConfig(reward_funcs=["exact_match"], loss_type=loss_type, beta=beta, importance_sampling_level=level,
                      epsilon=0.2, epsilon_high=epsilon_high, delta=delta, temperature=temperature,
                      max_completion_length=MAX_COMPLETION, **extra, **loss_args)


def our_rollout(tok, prompts, completions, trained, advantages, mask, old, ref, dapo_count) -> RolloutBatch:
    batch = completion_batch(prompts, completions, trained, tok.pad_token_id)
    rows = np.nonzero(batch.labels != IGNORE_INDEX)[0]
    return RolloutBatch(batch, np.asarray(advantages, np.float32), rows, flat(old, mask),
                        None if ref is None else flat(ref, mask), dapo_count=dapo_count)


# --------------------------------------------------------------------------- 1. the loss

def check_loss(backend, tiny_model_dir, loss_type, level, beta, delta=None, truncated_row=None, shift=0.35,
               bias_correction_kl=False, epsilon_high=None, **loss_args):
    """`loss_args`: sapo's and vespo's fields, given to TRL and to ours alike."""
    if epsilon_high is None:
        epsilon_high = CISPO_CAP if loss_type == "cispo" else 0.28
    trainer, tok = grpo_trainer(tiny_model_dir, per_device_train_batch_size=len(LENGTHS),
                                num_generations=NUM_GENERATIONS, gradient_accumulation_steps=1,
                                steps_per_generation=1, max_completion_length=MAX_COMPLETION, temperature=0.9,
                                beta=beta, loss_type=loss_type, importance_sampling_level=level, epsilon=0.2,
                                epsilon_high=epsilon_high, delta=delta, use_bias_correction_kl=bias_correction_kl,
                                **loss_args)
    model = trainer.model
    prompts, completions, inputs = make_case(tok, LENGTHS)
    if truncated_row is not None:             # mask_truncated_completions: the row keeps its ids, loses its mask
        inputs["completion_mask"][truncated_row] = 0
    mask = inputs["completion_mask"]
    with torch.no_grad():
        current, _ = trl_logps(trainer, inputs)
    row_shift = [s * shift / 0.35 for s in ROW_SHIFT]
    old = perturbed(current, mask, row_shift, 0.1, seed=1)
    ref = perturbed(current, mask, [0.0] * len(LENGTHS), 0.2, seed=2) if beta > 0 else None
    advantages = torch.tensor(ADVANTAGES, dtype=torch.float32)
    inputs.update(advantages=advantages, old_per_token_logps=old, num_items_in_batch=mask.sum())
    if ref is not None:
        inputs["ref_per_token_logps"] = ref

    theirs = trainer._compute_loss(model, inputs)
    theirs.backward()
    their_grads = lora_grads(model)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    if loss_type in CLIPPED:
        assert logged["clip_ratio/low_mean"] > 0 and logged["clip_ratio/high_mean"] > 0   # both sides clip
        assert logged["clip_ratio/region_mean"] < 1                                          # and not everything
    elif loss_type == "cispo":
        assert 0 < logged["cispo_clip_ratio"] < 1           # the cap binds on some tokens, not all
    elif loss_type == "vespo":
        assert 0 < logged["vespo/phi_seq_mean"] != 1        # the weights move away from phi(1) = 1
    if delta is not None:                     # the cap binds: an unclipped ratio above delta, advantage < 0
        ratio = torch.exp(current - old)[mask.bool()]
        negative = (advantages[:, None] < 0).expand_as(mask)[mask.bool()]
        assert bool(((ratio > delta) & negative).any())

    trained = [truncated_row != i for i in range(len(LENGTHS))]
    rb = our_rollout(tok, prompts, completions, trained, ADVANTAGES, mask, old, ref, float(mask.sum()))
    assert len(rb.rows) == int(mask.sum())
    objective = GrpoObjective(backend, our_config(loss_type, level, beta, delta, bias_correction_kl=bias_correction_kl,
                                                  epsilon_high=epsilon_high, **loss_args))
    total, metrics = objective(TorchModel(model, tok, str(tiny_model_dir)), rb)
    ours = total / objective.count(rb)
    ours.backward()
    diffs = {"loss": abs(val(ours) - val(theirs)), "grad": assert_grads_match(lora_grads(model), their_grads)}
    assert diffs["loss"] <= TOL, f"loss {val(ours)} vs TRL {val(theirs)}"
    names = set(logged) - NOT_LOGGED
    assert set(metrics) == names                            # the same metrics for this loss type, by name
    assert "entropy" in names and ("kl" in names) == (beta > 0)
    for name in sorted(names):
        diffs[name] = abs(metrics[name] - logged[name])
        assert metrics[name] == pytest.approx(logged[name], abs=TOL), name
    if beta > 0:
        assert logged["kl"] > 0
    return diffs


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_matches_trl(loss_type, level, beta, backend, tiny_model_dir):
    diffs = check_loss(backend, tiny_model_dir, loss_type, level, beta)
    report(f"grpo loss {loss_type}/{level}/beta={beta}", diffs)


@pytest.mark.xfail(not HAS_BIAS_CORRECTION, strict=True,
                   reason="TRL 1.16's default use_bias_correction_kl=True (KL x ratio) is not implemented in ours")
@pytest.mark.parametrize("loss_type,level", [("grpo", "token"), ("dapo", "sequence"), ("cispo", "token"),
                                             ("sapo", "sequence"), ("luspo", "sequence"), ("vespo", "token")])
def test_kl_with_bias_correction_matches_trl(loss_type, level, backend, tiny_model_dir):
    """TRL's default: per_token_kl * coef_1 (the KL gradient of DeepSeek-V3.2); the kl metric is of that product."""
    diffs = check_loss(backend, tiny_model_dir, loss_type, level, 0.04, bias_correction_kl=True)
    report(f"grpo loss {loss_type}/{level}/beta=0.04, use_bias_correction_kl", diffs)


@pytest.mark.parametrize("loss_type,level", [("dapo", "token"), ("luspo", "sequence"), ("cispo", "token"),
                                             ("sapo", "token")])
def test_loss_with_delta_matches_trl(loss_type, level, backend, tiny_model_dir):
    """Two-sided clipping: the unclipped ratio capped at delta (larger shifts, so the cap binds);
    cispo and sapo have no clipped term, and TRL ignores delta there."""
    diffs = check_loss(backend, tiny_model_dir, loss_type, level, 0.0, delta=1.5, shift=0.5)
    report(f"grpo loss {loss_type}/{level}/delta=1.5", diffs)


@pytest.mark.parametrize("loss_type,level,loss_args", [
    ("sapo", "token", {"sapo_temperature_pos": 0.6, "sapo_temperature_neg": 2.5}),
    ("sapo", "sequence", {"sapo_temperature_pos": 3.0, "sapo_temperature_neg": 0.5}),
    ("vespo", "token", {"vespo_k_pos": 1.0, "vespo_lambda_pos": 0.5, "vespo_k_neg": 4.0, "vespo_lambda_neg": 6.0}),
    ("vespo", "sequence", {"vespo_k_pos": 0.0, "vespo_lambda_pos": 0.0, "vespo_k_neg": 1.5, "vespo_lambda_neg": 1.0}),
])
def test_loss_with_its_own_fields_matches_trl(loss_type, level, loss_args, backend, tiny_model_dir):
    """sapo's temperatures and vespo's k and lambda away from their defaults (lambda 0: TRL's floor 1e-4)."""
    diffs = check_loss(backend, tiny_model_dir, loss_type, level, 0.04, **loss_args)
    report(f"grpo loss {loss_type}/{level}/{loss_args}", diffs)


def test_cispo_cap_below_one_matches_trl(backend, tiny_model_dir):
    """cispo's cap below 1 at sequence level, one completion masked: its sequence ratio is 1, above
    the cap, and TRL counts it as capped (its advantage is positive) in cispo_clip_ratio."""
    diffs = check_loss(backend, tiny_model_dir, "cispo", "sequence", 0.0, epsilon_high=0.9, truncated_row=4)
    report("grpo loss cispo/sequence/epsilon_high=0.9, one completion masked", diffs)


@pytest.mark.parametrize("loss_type,level,beta", [("grpo", "token", 0.0), ("dr_grpo", "token", 0.04),
                                                  ("grpo", "sequence", 0.04), ("dr_grpo", "sequence", 0.0),
                                                  ("cispo", "sequence", 0.04), ("sapo", "token", 0.0),
                                                  ("luspo", "sequence", 0.04), ("vespo", "token", 0.0),
                                                  ("vespo", "sequence", 0.04)])
def test_loss_with_masked_truncated_completion_matches_trl(loss_type, level, beta, backend, tiny_model_dir):
    """mask_truncated_completions: TRL zeroes the row's completion_mask (the row still counts in the
    per-completion mean); our batch simply has no labels on it."""
    diffs = check_loss(backend, tiny_model_dir, loss_type, level, beta, truncated_row=4)
    report(f"grpo loss {loss_type}/{level}/beta={beta}, one completion masked", diffs)


def test_loss_fields_are_trls():
    """The loss types and their fields have TRL's names and defaults, and every loss type is accepted
    at both importance-sampling levels, as TRL accepts them (it only warns: luspo is meant for
    sequence, vespo for token, and the token-summing types weigh sequences by length at sequence level)."""
    import dataclasses

    from trl import GRPOConfig

    trl_defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    fields = ["epsilon", "epsilon_high", "delta", "loss_type", "importance_sampling_level", "sapo_temperature_neg",
              "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"]
    ours = GrpoConfig(reward_funcs=["exact_match"])
    for name in fields:
        assert getattr(ours, name) == trl_defaults[name], name
    assert set(GrpoConfig.model_fields["loss_type"].annotation.__args__) == set(LOSS_TYPES)
    for loss_type in LOSS_TYPES:
        for level in ("token", "sequence"):
            GrpoConfig(reward_funcs=["exact_match"], loss_type=loss_type, importance_sampling_level=level)
    with pytest.raises(ValueError, match="sapo_temperature_pos"):     # TRL would divide by it: NaN
        GrpoConfig(reward_funcs=["exact_match"], loss_type="sapo", sapo_temperature_pos=0.0)


# --------------------------------------------------------------------------- 2. per-token log-probs

def test_per_token_logprobs_match_trl(backend, tiny_model_dir):
    temperature = 0.7
    trainer, tok = grpo_trainer(tiny_model_dir, per_device_train_batch_size=len(LENGTHS),
                                num_generations=NUM_GENERATIONS, max_completion_length=MAX_COMPLETION,
                                temperature=temperature)
    prompts, completions, inputs = make_case(tok, LENGTHS, seed=5)
    mask = inputs["completion_mask"]
    with torch.no_grad():
        their_logps, their_entropy = trl_logps(trainer, inputs)
    batch = completion_batch(prompts, completions, [True] * len(LENGTHS), tok.pad_token_id)
    logps, entropy = backend.token_logprobs(TorchModel(trainer.model, tok, str(tiny_model_dir)), batch, grad=False,
                                            temperature=temperature, entropy=True)
    theirs, their_ent = flat(their_logps, mask), flat(their_entropy, mask)
    assert logps.shape == (int(mask.sum()),) and entropy.shape == logps.shape
    diffs = {"logp": float(np.abs(backend.ops.to_numpy(logps) - theirs).max()),
             "entropy": float(np.abs(entropy - their_ent).max())}
    assert diffs["logp"] <= TOL and diffs["entropy"] <= TOL
    # The temperature matters at this tolerance: at 1.0 the log-probs are elsewhere.
    at_one, _ = backend.token_logprobs(TorchModel(trainer.model, tok, str(tiny_model_dir)), batch, grad=False)
    assert float(np.abs(backend.ops.to_numpy(at_one) - theirs).max()) > 1e-3
    report("per-token log-probs (T=0.7)", diffs)


# --------------------------------------------------------------------------- 3. advantages

NAN = float("nan")
G_ADV = 4
# [completion, function] with NaN for a function's None; weights [1.0, 0.5].
REWARD_TABLE = np.array([
    # group 0: a None from the second function (counted as 0), a partial tie
    [1.0, 0.5], [0.0, NAN], [0.5, 1.0], [1.0, 0.5],
    # group 1: every reward equal: std 0, advantages 0
    [0.5, 1.0], [0.5, 1.0], [0.5, 1.0], [0.5, 1.0],
    # group 2: completion 1 unscorable (every function None): out of the group's mean and std
    [2.0, NAN], [NAN, NAN], [-1.0, 0.5], [0.0, 1.5],
    # group 3: plain
    [-0.5, 0.0], [1.5, 0.25], [0.75, -0.5], [-2.0, 1.0],
    # group 4: one scorable completion: its group std is NaN (not zero), every advantage 0
    [NAN, NAN], [NAN, NAN], [1.0, NAN], [NAN, NAN],
])
REWARD_WEIGHTS = [1.0, 0.5]


def table_reward_funcs(table: np.ndarray):
    """Two reward functions that ignore the completions and return the table's columns (None for NaN)."""
    def column(j):
        return [None if np.isnan(v) else float(v) for v in table[:, j]]

    def reward_a(completions, **kwargs):
        assert len(completions) == len(table)
        return column(0)

    def reward_b(completions, **kwargs):
        return column(1)

    return [reward_a, reward_b]


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_match_trl(scale_rewards, tiny_model_dir):
    n_prompts = len(REWARD_TABLE) // G_ADV
    trainer, _ = grpo_trainer(tiny_model_dir, reward_funcs=table_reward_funcs(REWARD_TABLE),
                              dataset_rows=[{"prompt": f"prompt {k}"} for k in range(n_prompts)],
                              per_device_train_batch_size=len(REWARD_TABLE), num_generations=G_ADV,
                              max_completion_length=4, temperature=0.9, scale_rewards=scale_rewards,
                              reward_weights=REWARD_WEIGHTS)
    # What TRL's repeat sampler hands _generate_and_score_completions: each prompt num_generations times.
    inputs = [{"prompt": f"prompt {k}"} for k in range(n_prompts) for _ in range(G_ADV)]
    with torch.no_grad():
        out = trainer._generate_and_score_completions(inputs)
    theirs = np.array(trainer._logs["advantages"], dtype=np.float64)
    assert theirs.shape == (len(REWARD_TABLE),)
    assert np.allclose(out["advantages"].numpy(), theirs)
    for j, name in enumerate(["reward_a", "reward_b"]):          # TRL saw exactly our table
        np.testing.assert_array_equal(np.array(trainer._logs["rewards"][name]), REWARD_TABLE[:, j])

    ours = group_advantages(REWARD_TABLE, np.array(REWARD_WEIGHTS), G_ADV, scale_rewards)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    diffs = {"advantage": float(np.abs(ours.advantages - theirs).max()),
             "reward": abs(np.nanmean(ours.rewards) - logged["reward"]),
             "frac_reward_zero_std": abs(float(ours.std_is_zero.mean()) - logged["frac_reward_zero_std"])}
    assert diffs["advantage"] <= TOL
    assert diffs["reward"] <= TOL and diffs["frac_reward_zero_std"] <= 1e-7      # float32 0.2
    # The cases the table is built for, seen in TRL's answer too:
    assert np.all(theirs[4:8] == 0) and np.all(ours.advantages[4:8] == 0)            # tied group
    assert theirs[9] == 0 and ours.advantages[9] == 0 and np.isnan(ours.rewards[9])    # unscorable
    assert np.all(theirs[16:20] == 0) and np.all(ours.advantages[16:20] == 0)        # lone scorable one
    assert np.count_nonzero(theirs) >= 10                                              # a real signal
    if scale_rewards != "batch":
        assert ours.std_is_zero[4:8].all() and not ours.std_is_zero[16:20].any()
    report(f"advantages scale_rewards={scale_rewards}", diffs)


# --------------------------------------------------------------------------- 4. dapo, cispo, vespo over several steps

@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_off_policy_accumulation_matches_trl(loss_type, backend, tiny_model_dir):
    """steps_per_generation=2, gradient_accumulation_steps=1: TRL divides each micro-batch by the
    generation batch's tokens x 1 / 2; ours has dapo_count = generation tokens / 2."""
    epsilon_high = CISPO_CAP if loss_type == "cispo" else 0.28
    lengths = LENGTHS + [3, 6, 1, 2, 5, 2]           # a generation batch: two micro-batches of six
    micro = len(LENGTHS)
    trainer, tok = grpo_trainer(tiny_model_dir, per_device_train_batch_size=micro, num_generations=NUM_GENERATIONS,
                                gradient_accumulation_steps=1, steps_per_generation=2,
                                max_completion_length=MAX_COMPLETION, temperature=0.9, beta=0.0, loss_type=loss_type,
                                epsilon=0.2, epsilon_high=epsilon_high)
    from trl.trainer.utils import split_tensor_dict

    model = trainer.model
    prompts, completions, gen = make_case(tok, lengths, seed=7)
    mask = gen["completion_mask"]
    with torch.no_grad():
        current, _ = trl_logps(trainer, gen)
    old = perturbed(current, mask, ROW_SHIFT + ROW_SHIFT[::-1], 0.1, seed=3)
    advantages = ADVANTAGES + [-a for a in ADVANTAGES]
    gen.update(advantages=torch.tensor(advantages), old_per_token_logps=old, num_items_in_batch=mask.sum())
    gen_tokens = float(mask.sum())
    objective = GrpoObjective(backend, our_config(loss_type, "token", 0.0, epsilon_high=epsilon_high))
    handle = TorchModel(model, tok, str(tiny_model_dir))
    diffs = {}
    for k, chunk in enumerate(split_tensor_dict(gen, 2)):       # TRL's own cut: num_items_in_batch stays whole
        assert float(chunk["num_items_in_batch"]) == gen_tokens
        theirs = trainer._compute_loss(model, chunk)
        theirs.backward()
        their_grads = lora_grads(model)
        rows = slice(k * micro, (k + 1) * micro)
        cmask = chunk["completion_mask"]
        assert float(cmask.sum()) != gen_tokens / 2              # the share differs from the micro-batch's tokens
        rb = our_rollout(tok, prompts[rows], completions[rows], [True] * micro, advantages[rows], cmask,
                         chunk["old_per_token_logps"], None, gen_tokens / 2)
        total, _ = objective(handle, rb)
        ours = total / objective.count(rb)
        ours.backward()
        diffs[f"loss[{k}]"] = abs(val(ours) - val(theirs))
        diffs[f"grad[{k}]"] = assert_grads_match(lora_grads(model), their_grads)
        assert diffs[f"loss[{k}]"] <= TOL, f"loss {val(ours)} vs TRL {val(theirs)}"
    report(f"{loss_type}, steps_per_generation=2", diffs)
