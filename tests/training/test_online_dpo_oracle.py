"""Our online DPO against TRL 1.16's experimental OnlineDPOTrainer: the ranking of each pair (ties, a None,
the missing-EOS penalty), the loss and its LoRA gradients.

The oracle is TRL's own `training_step` on the tiny model with a randomised LoRA adapter, its
`_generate` replaced by one returning fixed completions (so both sides train on the same pairs) and
its reward function returning a fixed table. TRL lays a batch out as every prompt's first completion,
then every prompt's second; ours keeps each pair side by side: row 2k is TRL's row k, row 2k+1 its
row B + k.

Tolerance: 1e-5 absolute, fp32 (gradients: 1e-5 of the largest where it exceeds 1, as for IPO here).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mudpuppy import create_backend
from mudpuppy.backends.torch.backend import TorchModel
from mudpuppy.config.methods import OnlineDpoConfig
from mudpuppy.training.grpo_loss import RolloutBatch
from mudpuppy.training.online_dpo import OnlineDpoObjective, pair_preferences
from mudpuppy.training.rollout import completion_batch

from .test_grpo_oracle import PROMPT_LEN, TARGETS
from .test_preference_oracle import lora_grads, randomise_lora

TOL = 1e-5
pytest.importorskip("trl")
NAN = float("nan")
# TRL's order: first completions of prompts 0..3, then second completions. Pair 0: a tie (the first is
# chosen); pair 1: the second wins; pair 2: a None counts 0, so the first (0.5) wins; pair 3: the first
# wins on reward, but only it ends without EOS: with missing_eos_penalty 1 the second wins.
REWARDS = [1.0, 0.2, 0.5, 0.9,
           1.0, 0.8, NAN, 0.6]
LENGTHS = [4, 3, 5, 2, 6, 2, 3, 4]
ENDS_WITH_EOS = [True, True, True, False, True, True, True, True]


@pytest.fixture(scope="module")
def backend():
    return create_backend("cpu")


def online_dpo_trainer(tiny_model_dir, **config):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    args = OnlineDPOConfig(output_dir=str(tiny_model_dir.parent / "trl-odpo-out"), report_to="none", bf16=False,
                           gradient_checkpointing=False, use_cpu=True, per_device_train_batch_size=4, **config)

    def table(completions, **kwargs):
        return [None if np.isnan(v) else v for v in REWARDS]

    trainer = OnlineDPOTrainer(model=base, reward_funcs=[table], args=args, processing_class=tok,
                               train_dataset=Dataset.from_list([{"prompt": "hello"}] * 4),
                               peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                      task_type="CAUSAL_LM"))
    randomise_lora(trainer.model)
    trainer.model.train()
    return trainer, tok


def fixed_pairs(tok):
    """(prompts, completions) in TRL's order, and TRL's padded tensors."""
    rng = np.random.default_rng(0)
    low = max(tok.all_special_ids) + 1
    prompts = [rng.integers(low, len(tok), PROMPT_LEN).tolist() for _ in range(4)] * 2
    completions = [rng.integers(low, len(tok), n).tolist() for n in LENGTHS]
    completions = [c[:-1] + [tok.eos_token_id] if eos else c for c, eos in zip(completions, ENDS_WITH_EOS)]
    width = max(LENGTHS)
    ids = torch.full((8, width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((8, width), dtype=torch.long)
    for i, c in enumerate(completions):
        ids[i, : len(c)], mask[i, : len(c)] = torch.as_tensor(c), 1
    return prompts, completions, (torch.as_tensor(prompts), torch.ones((8, PROMPT_LEN), dtype=torch.long), ids, mask)


OURS = [0, 4, 1, 5, 2, 6, 3, 7]          # our row r is TRL's row OURS[r]


# IPO at beta 1 (target margin 0.5): its loss is still about 24 and its gradients up to about 60 on these
# pairs, which fp32 sums hold to about 1e-4: gradients are compared at 1e-5 of their largest value.
@pytest.mark.parametrize("loss_type, beta, penalty", [("sigmoid", 0.1, None), ("ipo", 1.0, None),
                                                      ("sigmoid", 0.1, 1.0)])
def test_loss_and_ranking_match_trl(loss_type, beta, penalty, backend, tiny_model_dir):
    trainer, tok = online_dpo_trainer(tiny_model_dir, beta=beta, loss_type=loss_type, missing_eos_penalty=penalty)
    prompts, completions, tensors = fixed_pairs(tok)
    trainer._generate = lambda model, prompts_, images=None: (*tensors, None)
    theirs = float(trainer.training_step(trainer.model, {"prompt": ["hello"] * 4}))
    their_grads = lora_grads(trainer.model)

    stops = {tok.eos_token_id}
    truncated = np.array([completions[r][-1] not in stops for r in OURS])
    adv = pair_preferences(np.array(REWARDS)[OURS][:, None], np.array([1.0]), truncated, penalty)
    chosen_first = [adv.advantages[2 * k] > 0 for k in range(4)]
    assert chosen_first == [True, False, True, penalty is None]      # ties, None and the penalty, as designed
    batch = completion_batch([prompts[r] for r in OURS], [completions[r] for r in OURS], [True] * 8,
                             tok.pad_token_id)
    rows = np.nonzero(batch.labels != -100)[0]
    handle = TorchModel(trainer.model, tok, str(tiny_model_dir))
    ref, _ = backend.token_logprobs(handle, batch, grad=False, reference=True)
    rb = RolloutBatch(batch, adv.advantages, rows, None, backend.ops.to_numpy(ref).astype(np.float32))
    objective = OnlineDpoObjective(backend, OnlineDpoConfig(reward_funcs=["exact_match"], beta=beta,
                                                            loss_type=loss_type, missing_eos_penalty=penalty))
    total, metrics = objective(handle, rb)
    ours = total / objective.count(rb)
    ours.backward()
    assert abs(float(ours.detach()) - theirs) <= TOL
    mine = lora_grads(trainer.model)
    largest = max(float(g.abs().max()) for g in their_grads.values())
    assert largest > 1e-3                                              # a real gradient, not zeros
    scale = max(1.0, largest)
    worst = max(float((mine[k] - their_grads[k]).abs().max()) for k in mine)
    assert worst <= TOL * scale, f"largest LoRA gradient difference {worst:.2e} (gradients up to {scale:.1f})"
    assert metrics["reward_margin"] == pytest.approx(trainer.stats["rewards/margins"][-1], abs=TOL)
    assert metrics["reward_chosen"] == pytest.approx(trainer.stats["rewards/chosen"][-1], abs=TOL)
