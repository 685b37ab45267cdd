"""Our preference and reward losses against TRL 1.16's, value and gradient, on the same model and batch.

For DPO (sigmoid, ipo) and KTO the oracle is TRL's own trainer: a real
DPOTrainer / KTOTrainer is built on the tiny model with a LoRA config, its
`_compute_loss` runs on a batch made from our tokenized data, and our
objective then runs on the very same PEFT model. The LoRA weights are
randomised first, so the policy differs from the reference (the base with
the adapter off) and every gradient is non-zero.

TRL's CPO (SimPO) and ORPO trainers tokenize with their own pipeline, so
for those the oracle is their loss methods called directly (`cpo_loss`,
`odds_ratio_loss` with a minimal `self`, the static `get_batch_logps`) on
full-model logits: an independent path to the sequence log-probs too.

Where our semantics differ from TRL's on purpose, the test says so and
checks ours against a hand computation instead:

- DPO label smoothing: TRL 1.16 ignores `label_smoothing` for loss_type
  sigmoid (it feeds robust/exo/aot only); ours is conservative DPO.
- ORPO's NLL: TRL's ORPOTrainer averages it over prompt and response
  tokens; ours over the response only, as SFT does. The odds-ratio term is
  TRL's, called directly; the NLL is TRL's formula on response labels.
- KTO's mismatched pairs: TRL rotates completions inside each batch at
  data-preparation time; we rotate once over the dataset. The loss is
  computed from whatever pairs the batch carries, so the test hands TRL our
  pairs.

Tolerance: 1e-5 absolute, fp32, for values and for every LoRA gradient.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mudpuppy import create_backend, load_config
from mudpuppy.backends.torch.backend import TorchModel
from mudpuppy.config import PreferenceConfig
from mudpuppy.data import prepare_data
from mudpuppy.data.pairs import collate_items, kto_items, pair_items, role_batch
from mudpuppy.training.preference import PreferenceObjective
from mudpuppy.training.reward import RewardObjective

from ..conftest import QUICKSTART_DATA, randomize_lora

TOL = 1e-5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
pytest.importorskip("trl")


@pytest.fixture(scope="module")
def backend():
    return create_backend("cpu")


def tokenized(tiny_model_dir, tmp_path, data_file: str, method: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    cfg = load_config({"model": {"base_model": str(tiny_model_dir)}, "backend": "cpu", "method": "preference",
                       "preference": {"type": method},
                       "data": {"datasets": [{"path": str(QUICKSTART_DATA / data_file)}], "sequence_len": 128,
                                "cache": False},
                       "output_dir": str(tmp_path / "unused")})
    return tok, prepare_data(cfg, tok).train


def randomise_lora(model) -> None:
    """Non-zero LoRA weights: the policy moves away from the reference, every gradient is non-zero."""
    randomize_lora(model, seed=0, scale=0.3, part="lora_")


def lora_grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    assert grads and all(g is not None for g in grads.values())
    return grads


def assert_grads_match(ours: dict, theirs: dict) -> float:
    assert ours.keys() == theirs.keys()
    worst = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
    assert worst <= TOL, f"largest LoRA gradient difference {worst:.2e}"
    assert max(float(g.abs().max()) for g in theirs.values()) > 1e-3     # a real gradient, not zeros
    return worst


def val(x: torch.Tensor) -> float:
    return float(x.detach())


def report(name: str, loss_diff: float, grad_diff: float) -> None:
    """Shown with `pytest -s`: the measured agreement, for the notes."""
    print(f"\n{name}: |loss - oracle| {loss_diff:.1e}, max |grad - oracle| {grad_diff:.1e}")


def completion_mask(labels: np.ndarray) -> torch.Tensor:
    """TRL's completion_mask from our shifted labels: token t is trained when label t-1 targets it."""
    mask = np.zeros_like(labels)
    mask[:, 1:] = labels[:, :-1] != -100
    return torch.as_tensor(mask)


def unshifted_labels(labels: np.ndarray) -> torch.Tensor:
    """The labels CPO/ORPO's get_batch_logps expects: token ids where trained, -100 elsewhere, unshifted."""
    out = np.full_like(labels, -100)
    out[:, 1:] = labels[:, :-1]
    return torch.as_tensor(out)


def trl_model(trainer_cls, config_cls, tiny_model_dir, tok, dataset_rows, **config):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    args = config_cls(output_dir=str(tiny_model_dir.parent / "trl-out"), report_to="none", bf16=False,
                      gradient_checkpointing=False, use_cpu=True, **config)
    trainer = trainer_cls(model=base, args=args, train_dataset=Dataset.from_list(dataset_rows),
                          processing_class=tok,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, task_type="CAUSAL_LM"))
    randomise_lora(trainer.model)
    trainer.model.train()
    return trainer


# --------------------------------------------------------------------------- DPO and IPO: TRL's DPOTrainer

@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_and_ipo_match_trl_dpo_trainer(loss_type, backend, tiny_model_dir, tmp_path):
    from trl import DPOConfig, DPOTrainer

    tok, train = tokenized(tiny_model_dir, tmp_path, "sample_preference.jsonl", "dpo")
    items = collate_items(pair_items(train), tok.pad_token_id)
    beta = 0.3
    trainer = trl_model(DPOTrainer, DPOConfig, tiny_model_dir, tok, [{"prompt": "a", "chosen": "b", "rejected": "c"}],
                        beta=beta, loss_type=[loss_type], per_device_train_batch_size=items.size)
    model = trainer.model
    inputs = {"input_ids": torch.as_tensor(items.batch.input_ids),
              "attention_mask": torch.as_tensor(items.batch.attention_mask),
              "completion_mask": completion_mask(items.batch.labels)}
    theirs = trainer._compute_loss(model, inputs, False)
    theirs.backward()
    their_grads = lora_grads(model)

    ours_type = "dpo" if loss_type == "sigmoid" else "ipo"
    objective = PreferenceObjective(backend, PreferenceConfig(type=ours_type, beta=beta))
    total, metrics = objective(TorchModel(model, tok, str(tiny_model_dir)), items)
    ours = total / items.size
    ours.backward()
    assert abs(val(ours) - val(theirs)) <= TOL
    grad_diff = assert_grads_match(lora_grads(model), their_grads)
    logged = trainer._metrics["train"]
    assert metrics["reward_chosen"] == pytest.approx(logged["rewards/chosen"][-1], abs=TOL)
    assert metrics["reward_margin"] == pytest.approx(logged["rewards/margins"][-1], abs=TOL)
    assert metrics["reward_accuracy"] == pytest.approx(logged["rewards/accuracies"][-1], abs=TOL)
    report(f"dpo {loss_type}", abs(val(ours) - val(theirs)), grad_diff)


def test_dpo_label_smoothing_is_conservative_dpo(backend, tiny_model_dir, tmp_path):
    """TRL 1.16's sigmoid loss ignores label_smoothing; ours is cDPO, checked by hand here,
    with log-probs from full-vocabulary logits (an independent path to ours)."""
    tok, train = tokenized(tiny_model_dir, tmp_path, "sample_preference.jsonl", "dpo")
    items = collate_items(pair_items(train), tok.pad_token_id)
    handle = backend.load_model(load_config(_cfg(tiny_model_dir, tmp_path)).model, "fp32")
    backend.attach_adapter(handle, SimpleNamespace(type="lora", r=4, alpha=8, dropout=0.0, target_modules=TARGETS,
                                                   rslora=False))
    randomise_lora(handle.model)
    beta, eps, n = 0.3, 0.2, items.size
    total, _ = PreferenceObjective(backend, PreferenceConfig(type="dpo", beta=beta, label_smoothing=eps))(
        handle, items)
    (total / n).backward()
    ours = lora_grads(handle.model)

    policy = full_logits_logps(handle.model, items)
    with torch.no_grad(), handle.model.disable_adapter():
        ref = full_logits_logps(handle.model, items)
    z = beta * ((policy[:n] - ref[:n]) - (policy[n:] - ref[n:]))
    hand = (-(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)).mean()
    hand.backward()
    assert abs(val(total / n) - val(hand)) <= TOL
    grad_diff = assert_grads_match(ours, lora_grads(handle.model))
    report("dpo label smoothing (hand)", abs(val(total / n) - val(hand)), grad_diff)


def full_logits_logps(model, items) -> torch.Tensor:
    """Summed log p(target) per row from the full logits: log_softmax, then gather."""
    logits = model(input_ids=torch.as_tensor(items.batch.input_ids),
                   attention_mask=torch.as_tensor(items.batch.attention_mask)).logits
    labels = torch.as_tensor(items.batch.labels)
    mask = labels != -100
    picked = torch.log_softmax(logits.float(), -1).gather(2, labels.clamp(min=0)[..., None])[..., 0]
    return (picked * mask).sum(1)


def _cfg(tiny_model_dir, tmp_path) -> dict:
    return {"model": {"base_model": str(tiny_model_dir)}, "backend": "cpu",
            "data": {"datasets": [{"path": str(QUICKSTART_DATA / "sample_preference.jsonl")}]},
            "output_dir": str(tmp_path / "unused")}


# --------------------------------------------------------------------------- SimPO and ORPO: TRL's loss methods

@pytest.fixture()
def lora_handle(backend, tiny_model_dir, tmp_path):
    handle = backend.load_model(load_config(_cfg(tiny_model_dir, tmp_path)).model, "fp32")
    backend.attach_adapter(handle, SimpleNamespace(type="lora", r=4, alpha=8, dropout=0.0, target_modules=TARGETS,
                                                   rslora=False))
    randomise_lora(handle.model)
    return handle


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_matches_trl_cpo_simpo(label_smoothing, backend, lora_handle, tiny_model_dir, tmp_path):
    from trl.experimental.cpo import CPOTrainer

    tok, train = tokenized(tiny_model_dir, tmp_path, "sample_preference.jsonl", "simpo")
    items = collate_items(pair_items(train), tok.pad_token_id)
    beta, gamma, n = 2.0, 0.7, items.size
    model = lora_handle.model
    logits = model(input_ids=torch.as_tensor(items.batch.input_ids),
                   attention_mask=torch.as_tensor(items.batch.attention_mask), use_cache=False).logits
    logps = CPOTrainer.get_batch_logps(logits, unshifted_labels(items.batch.labels), average_log_prob=True)
    trl_self = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta,
                               label_smoothing=label_smoothing, accelerator=SimpleNamespace(device="cpu"))
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(trl_self, logps[:n], logps[n:])
    theirs = losses.mean()      # cpo_alpha = 0 for SimPO: no NLL term
    theirs.backward()
    their_grads = lora_grads(model)

    pref = PreferenceConfig(type="simpo", beta=beta, gamma=gamma, label_smoothing=label_smoothing)
    total, metrics = PreferenceObjective(backend, pref)(lora_handle, items)
    (total / n).backward()
    assert abs(val(total / n) - val(theirs)) <= TOL
    grad_diff = assert_grads_match(lora_grads(model), their_grads)
    report(f"simpo eps={label_smoothing}", abs(val(total / n) - val(theirs)), grad_diff)
    assert metrics["reward_chosen"] == pytest.approx(float(chosen_rewards.mean()), abs=TOL)
    assert metrics["reward_accuracy"] == pytest.approx(float((chosen_rewards > rejected_rewards).float().mean()))


def test_orpo_matches_trl_odds_ratio_and_nll(backend, lora_handle, tiny_model_dir, tmp_path):
    from trl.experimental.orpo import ORPOTrainer

    tok, train = tokenized(tiny_model_dir, tmp_path, "sample_preference.jsonl", "orpo")
    items = collate_items(pair_items(train), tok.pad_token_id)
    lam, n = 0.25, items.size
    model = lora_handle.model
    logits = model(input_ids=torch.as_tensor(items.batch.input_ids),
                   attention_mask=torch.as_tensor(items.batch.attention_mask), use_cache=False).logits
    labels = unshifted_labels(items.batch.labels)
    logps = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    trl_self = SimpleNamespace(beta=lam, accelerator=SimpleNamespace(device="cpu"))
    losses, chosen_rewards, _, _, log_odds = ORPOTrainer.odds_ratio_loss(trl_self, logps[:n], logps[n:])
    # TRL's cross_entropy_loss lines (ORPOTrainer.concatenated_forward), fed response-only labels:
    # TRL itself passes labels covering the prompt too (our documented difference).
    shift_logits = logits[:n, :-1, :].contiguous().view(-1, logits.shape[-1])
    shift_labels = labels[:n, 1:].contiguous().view(-1)
    nll = torch.nn.CrossEntropyLoss()(shift_logits, shift_labels)
    theirs = nll - losses.mean()
    theirs.backward()
    their_grads = lora_grads(model)

    total, metrics = PreferenceObjective(backend, PreferenceConfig(type="orpo", orpo_lambda=lam))(lora_handle, items)
    (total / n).backward()
    assert abs(val(total / n) - val(theirs)) <= TOL
    report("orpo", abs(val(total / n) - val(theirs)), assert_grads_match(lora_grads(model), their_grads))
    assert metrics["nll"] == pytest.approx(val(nll), abs=TOL)
    assert metrics["log_odds"] == pytest.approx(val(log_odds), abs=TOL)
    assert metrics["reward_chosen"] == pytest.approx(float(chosen_rewards.mean()), abs=TOL)


# --------------------------------------------------------------------------- KTO: TRL's KTOTrainer

def test_kto_matches_trl_kto_trainer(backend, tiny_model_dir, tmp_path):
    from trl import KTOConfig, KTOTrainer

    tok, train = tokenized(tiny_model_dir, tmp_path, "sample_kto.jsonl", "kto")
    items = collate_items(kto_items(train, 128), tok.pad_token_id)
    beta, wd, wu = 0.4, 1.3, 0.7
    trainer = trl_model(KTOTrainer, KTOConfig, tiny_model_dir, tok,
                        [{"prompt": "a", "completion": "b", "label": True},
                         {"prompt": "c", "completion": "d", "label": False}],
                        beta=beta, desirable_weight=wd, undesirable_weight=wu,
                        per_device_train_batch_size=items.size)
    model = trainer.model
    matched, mismatched = role_batch(items, 0), role_batch(items, 1)
    inputs = {"input_ids": torch.as_tensor(matched.input_ids),
              "attention_mask": torch.as_tensor(matched.attention_mask),
              "completion_mask": completion_mask(matched.labels),
              "KL_input_ids": torch.as_tensor(mismatched.input_ids),
              "KL_attention_mask": torch.as_tensor(mismatched.attention_mask),
              "KL_completion_mask": completion_mask(mismatched.labels),
              "label": torch.as_tensor(items.labels > 0.5)}
    theirs = trainer._compute_loss(model, inputs, False)
    theirs.backward()
    their_grads = lora_grads(model)

    pref = PreferenceConfig(type="kto", beta=beta, desirable_weight=wd, undesirable_weight=wu)
    total, metrics = PreferenceObjective(backend, pref)(TorchModel(model, tok, str(tiny_model_dir)), items)
    (total / items.size).backward()
    assert abs(val(total / items.size) - val(theirs)) <= TOL
    report("kto", abs(val(total / items.size) - val(theirs)), assert_grads_match(lora_grads(model), their_grads))
    logged = trainer._metrics["train"]
    assert metrics["kl"] == pytest.approx(logged["kl"][-1], abs=TOL)
    assert metrics["kl"] > 0          # the KL baseline is exercised, not clipped away
    assert metrics["reward_chosen"] == pytest.approx(logged["rewards/chosen"][-1], abs=TOL)
    assert metrics["reward_rejected"] == pytest.approx(logged["rewards/rejected"][-1], abs=TOL)


# --------------------------------------------------------------------------- reward model: TRL's RewardTrainer formula

def test_bradley_terry_matches_trl_reward_loss(backend, tiny_model_dir, tmp_path):
    """TRL's RewardTrainer.compute_loss lines: chunk the sequence-classification logits, -logsigmoid(c - r)."""
    tok, train = tokenized(tiny_model_dir, tmp_path, "sample_preference.jsonl", "dpo")
    items = collate_items(pair_items(train), tok.pad_token_id)
    handle = backend.load_model(load_config(_cfg(tiny_model_dir, tmp_path)).model, "fp32",
                                head="sequence_classification")
    backend.attach_adapter(handle, SimpleNamespace(type="lora", r=4, alpha=8, dropout=0.0, target_modules=TARGETS,
                                                   rslora=False))
    randomise_lora(handle.model)
    outputs = handle.model(input_ids=torch.as_tensor(items.batch.input_ids),
                           attention_mask=torch.as_tensor(items.batch.attention_mask), use_cache=False)
    rewards_chosen, rewards_rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)
    theirs = -F.logsigmoid(rewards_chosen - rewards_rejected).mean()
    theirs.backward()
    their_grads = lora_grads(handle.model)
    assert any("score" in k for k in their_grads)       # the new head trains (PEFT modules_to_save)

    total, metrics = RewardObjective(backend, "bradley_terry")(handle, items)
    (total / items.size).backward()
    assert abs(val(total / items.size) - val(theirs)) <= TOL
    report("reward bradley-terry", abs(val(total / items.size) - val(theirs)),
           assert_grads_match(lora_grads(handle.model), their_grads))
    assert metrics["reward_accuracy"] == pytest.approx(float((rewards_chosen > rewards_rejected).float().mean()))
