"""Our RLOO maths against TRL 1.16's RLOOTrainer: advantages (with reward clipping, normalisation and
the KL in the reward) and the loss with its gradients and metrics.

The oracle is TRL's own trainer on the tiny model with a randomised LoRA adapter, as in
test_grpo_oracle.py (whose helpers build the batches):

- the advantages: TRL's real `_generate_and_score_completions` (it generates with the tiny
  model, then scores with reward functions returning a fixed table, None included), read
  back from its logs; with beta > 0 the KL TRL subtracts comes from its own generated
  completions, which our backend scores again (policy and reference: the adapter off);
- the loss: TRL's `_compute_loss` on a batch we build (completions of different lengths,
  advantages of both signs, old log-probs shifted so that the ratio clips on both sides,
  a completion with no loss tokens), then our RlooObjective on the very same PEFT model.

Tolerance: 1e-5 absolute, fp32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mudpuppy import create_backend
from mudpuppy.backends.torch.backend import TorchModel
from mudpuppy.config.methods import RlooConfig
from mudpuppy.training.rloo import RlooObjective, rloo_advantages
from mudpuppy.training.rollout import completion_batch

from .test_grpo_oracle import (G_ADV, LENGTHS, REWARD_TABLE, REWARD_WEIGHTS, grpo_trainer, make_case, our_rollout,
                               perturbed, table_reward_funcs, trl_logps)
from .test_preference_oracle import assert_grads_match, lora_grads

TOL = 1e-5
pytest.importorskip("trl")
ADVANTAGES = [1.2, -0.9, 0.6, -1.3, 0.8, -0.4]
# Per-row shift of the old log-probs. The ratio is per sequence, exp(sum of token shifts), so the
# shifts are per token / length: row 2 (advantage > 0) clips high, row 3 (advantage < 0) clips low.
SEQ_SHIFT = [0.35, -0.35, -0.35, 0.35, 0.0, 0.0]


@pytest.fixture(scope="module")
def backend():
    return create_backend("cpu")


def rloo_trainer(tiny_model_dir, **kwargs):
    """A real RLOOTrainer on the tiny model with a LoRA adapter (randomised), in train mode."""
    return grpo_trainer(tiny_model_dir, kind="RLOO", **kwargs)


# --------------------------------------------------------------------------- 1. advantages

def our_kl(backend, trainer, tok, tiny_model_dir, out, temperature) -> np.ndarray:
    """Each of TRL's generated completions' summed (logp - ref logp), from our backend."""
    mask = out["completion_mask"]
    prompts = [p[m.bool()].tolist() for p, m in zip(out["prompt_ids"], out["prompt_mask"])]
    completions = [c[m.bool()].tolist() for c, m in zip(out["completion_ids"], mask)]
    batch = completion_batch(prompts, completions, [bool(m.any()) for m in mask], tok.pad_token_id)
    handle = TorchModel(trainer.model, tok, str(tiny_model_dir))
    logps, _ = backend.token_logprobs(handle, batch, grad=False, temperature=temperature)
    ref, _ = backend.token_logprobs(handle, batch, grad=False, temperature=temperature, reference=True)
    rows = np.nonzero(batch.labels != -100)[0]
    diff = backend.ops.to_numpy(logps).astype(np.float64) - backend.ops.to_numpy(ref)
    return np.bincount(rows, weights=diff, minlength=len(completions))


@pytest.mark.parametrize("normalize, clip, beta", [(False, None, 0.0), (True, None, 0.0), (False, (-0.5, 1.0), 0.0),
                                                   (True, (-0.5, 1.0), 0.0), (False, None, 0.05),
                                                   (True, (-0.5, 1.0), 0.05)])
def test_advantages_match_trl(normalize, clip, beta, backend, tiny_model_dir):
    n_prompts = len(REWARD_TABLE) // G_ADV
    trainer, tok = rloo_trainer(tiny_model_dir, reward_funcs=table_reward_funcs(REWARD_TABLE),
                                dataset_rows=[{"prompt": f"prompt {k}"} for k in range(n_prompts)],
                                per_device_train_batch_size=len(REWARD_TABLE), num_generations=G_ADV,
                                max_completion_length=4, temperature=0.9, normalize_advantages=normalize,
                                reward_clip_range=clip, reward_weights=REWARD_WEIGHTS, beta=beta)
    inputs = [{"prompt": f"prompt {k}"} for k in range(n_prompts) for _ in range(G_ADV)]
    with torch.no_grad():
        out = trainer._generate_and_score_completions(inputs)
    theirs = np.array(trainer._logs["advantages"], dtype=np.float64)
    for j, name in enumerate(["reward_a", "reward_b"]):          # TRL saw exactly our table
        np.testing.assert_array_equal(np.array(trainer._logs["rewards"][name]), REWARD_TABLE[:, j])
    kl = our_kl(backend, trainer, tok, tiny_model_dir, out, 0.9) if beta else None
    if beta:
        assert np.abs(kl).max() > 1e-2                           # the adapter moves the policy: a real KL
    ours = rloo_advantages(REWARD_TABLE, np.array(REWARD_WEIGHTS), G_ADV, normalize, clip, kl, beta)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert float(np.abs(ours.advantages - theirs).max()) <= TOL
    assert abs(np.nanmean(ours.rewards) - logged["reward"]) <= TOL
    assert abs(float(ours.std_is_zero.mean()) - logged["frac_reward_zero_std"]) <= 1e-7
    assert theirs[9] == 0 and ours.advantages[9] == 0                                 # unscorable
    assert np.all(theirs[16:20] == 0) and np.all(ours.advantages[16:20] == 0)         # lone scorable one
    if not normalize and not beta:
        assert np.all(ours.advantages[4:8] == 0)                                      # tied group
    assert np.count_nonzero(theirs) >= 10


def test_leave_one_out_by_hand():
    """A group of three: each advantage is the reward less the mean of the two others."""
    adv = rloo_advantages(np.array([[1.0], [4.0], [7.0]]), np.array([1.0]), 3).advantages
    np.testing.assert_allclose(adv, [1.0 - 5.5, 4.0 - 4.0, 7.0 - 2.5])


# --------------------------------------------------------------------------- 2. the loss

@pytest.mark.parametrize("off_policy", [True, False])
@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_loss_matches_trl(off_policy, epsilon_high, backend, tiny_model_dir):
    trainer, tok = rloo_trainer(tiny_model_dir, per_device_train_batch_size=len(LENGTHS), num_generations=3,
                                gradient_accumulation_steps=1, steps_per_generation=1, max_completion_length=8,
                                temperature=0.9, epsilon=0.2, epsilon_high=epsilon_high)
    model = trainer.model
    prompts, completions, inputs = make_case(tok, LENGTHS)
    inputs["completion_mask"][5] = 0                  # a truncated completion, masked: no loss tokens, ratio 1
    mask = inputs["completion_mask"]
    with torch.no_grad():
        current, _ = trl_logps(trainer, inputs)
    shift = [s / n for s, n in zip(SEQ_SHIFT, LENGTHS)] if off_policy else [0.0] * len(LENGTHS)
    old = perturbed(current, mask, shift, 0.05 if off_policy else 0.0, seed=1)
    advantages = torch.tensor(ADVANTAGES, dtype=torch.float32)
    inputs.update(advantages=advantages, old_logps=(old * mask).sum(1))
    theirs = trainer._compute_loss(model, inputs)
    theirs.backward()
    their_grads = lora_grads(model)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    if off_policy:
        assert logged["clip_ratio/low_mean"] > 0 and logged["clip_ratio/high_mean"] > 0

    trained = [i != 5 for i in range(len(LENGTHS))]
    rb = our_rollout(tok, prompts, completions, trained, ADVANTAGES, mask, old, None, 0.0)
    if not off_policy:
        rb.old_logps = None                           # ours: on-policy, the ratio is exactly 1
    cfg = RlooConfig(reward_funcs=["exact_match"], temperature=0.9, epsilon=0.2, epsilon_high=epsilon_high)
    objective = RlooObjective(backend, cfg)
    total, metrics = objective(TorchModel(model, tok, str(tiny_model_dir)), rb)
    ours = total / objective.count(rb)
    ours.backward()
    assert abs(float(ours.detach()) - float(theirs.detach())) <= TOL
    assert_grads_match(lora_grads(model), their_grads)
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy"):
        assert metrics[name] == pytest.approx(logged[name], abs=TOL), name


def test_rloo_fields_are_trls():
    """Our defaults are RLOOConfig's where the names are shared."""
    from trl import RLOOConfig

    theirs, ours = RLOOConfig(output_dir="unused", report_to="none", bf16=False, use_cpu=True), RlooConfig(reward_funcs=["exact_match"])
    for name in ("num_generations", "beta", "epsilon", "epsilon_high", "normalize_advantages", "reward_clip_range",
                 "num_iterations", "mask_truncated_completions", "temperature", "top_p"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_bad_clip_range_is_named():
    with pytest.raises(ValueError, match="reward_clip_range"):
        RlooConfig(reward_funcs=["exact_match"], reward_clip_range=(1.0, 0.0))
