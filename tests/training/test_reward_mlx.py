"""Reward and process reward models on MLX against torch: same weights, same batches, within 1e-4.

The torch model (LoRA with a random B, and its freshly initialised head) is
saved as a PEFT adapter, head included as modules_to_save, and loaded into
MLX, so both runtimes start from identical weights. A short MLX `rm` run
must then save a model that plain transformers loads and scores alike.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core")

from mudpuppy import create_backend, load_config, run
from mudpuppy.data import prepare_data
from mudpuppy.data.pairs import collate_items, collate_steps, pair_items, scored_items
from mudpuppy.training.reward import HEADS, RewardObjective, StepObjective

from .test_preference_mlx import same_adapter
from .test_reward import reward_config

pytestmark = pytest.mark.mlx
TOL = 1e-4


@pytest.fixture(scope="module")
def backends():
    return create_backend("cpu"), create_backend("mlx")


def batches_for(cfg, tokenizer, items_fn, collate):
    items = items_fn(prepare_data(cfg, tokenizer).train)
    return [collate(items[i : i + 4], tokenizer.pad_token_id) for i in range(0, len(items), 4)][:2]


def train_both(backends, handles, objectives, batches, training_cfg, steps=2):
    """Objective values after each of `steps` AdamW updates: they agree only if the gradients did."""
    out = []
    for backend, handle, objective in zip(backends, handles, objectives):
        trainer = backend.create_trainer(handle, training_cfg)
        values = []
        for _ in range(steps):
            trainer.step([batches[0]], 1e-2, objective=objective)
            loss, _ = objective(handle, batches[1], grad=False)
            values.append(float(backend.ops.to_numpy(loss)))
        out.append(values)
    return out


def check(backends, cfg_dict, head, objectives, batches_fn, tmp_path) -> float:
    """The largest gap between the runtimes: loss and metrics, then the loss after each update."""
    cfg = load_config(cfg_dict)
    th, mh = same_adapter(backends, cfg, tmp_path, head=head)
    batches = batches_fn(cfg, th.tokenizer)
    (t_loss, t_metrics), (m_loss, m_metrics) = (objectives[0](th, batches[0], grad=False),
                                                objectives[1](mh, batches[0], grad=False))
    diffs = [abs(float(backends[0].ops.to_numpy(t_loss)) - float(backends[1].ops.to_numpy(m_loss)))]
    assert t_metrics.keys() == m_metrics.keys()
    diffs += [abs(t_metrics[k] - m_metrics[k]) for k in t_metrics]
    t_values, m_values = train_both(backends, (th, mh), objectives, batches, cfg.training)
    diffs += [abs(a - b) for a, b in zip(t_values, m_values)]
    assert max(diffs) < TOL, (t_metrics, m_metrics, t_values, m_values)
    print(f"largest torch/MLX gap: {max(diffs):.2e}")
    return max(diffs)


def test_bradley_terry_agrees_with_torch(backends, tiny_model_dir, tmp_path):
    cfg = reward_config(tiny_model_dir, tmp_path)
    objectives = [RewardObjective(b, "bradley_terry") for b in backends]
    check(backends, cfg, HEADS["rm"], objectives,
          lambda c, tok: batches_for(c, tok, pair_items, collate_items), tmp_path)


def test_mean_squared_error_agrees_with_torch(backends, tiny_model_dir, tmp_path):
    cfg = reward_config(tiny_model_dir, tmp_path, data="smart_home_reward")
    objectives = [RewardObjective(b, "mse") for b in backends]
    check(backends, cfg, HEADS["rm"], objectives,
          lambda c, tok: batches_for(c, tok, scored_items, collate_items), tmp_path)


def test_process_reward_step_loss_agrees_with_torch(backends, tiny_model_dir, tmp_path, monkeypatch):
    cfg = reward_config(tiny_model_dir, tmp_path, method="prm", data="arithmetic_prm")
    objectives = [StepObjective(b) for b in backends]
    # The token head drops 10% of hidden states while training, each runtime with its own RNG;
    # with it off, the updates must agree too.
    from mudpuppy.backends.mlx import loading
    from torch.nn import Dropout

    monkeypatch.setattr(Dropout, "forward", lambda self, x: x)
    real = loading.ScoreModel.__init__
    monkeypatch.setattr(loading.ScoreModel, "__init__", lambda self, *a, **k: real(self, *a, **{**k, "dropout": 0.0}))
    check(backends, cfg, HEADS["prm"], objectives,
          lambda c, tok: batches_for(c, tok, lambda t: t, collate_steps), tmp_path)


def test_an_mlx_reward_model_reloads_with_plain_transformers_and_peft(backends, tiny_model_dir, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    cfg = {**reward_config(tiny_model_dir, tmp_path), "backend": "mlx"}
    result = run(load_config(cfg), backends[1], echo=lambda *_: None)
    assert result.after.accuracy_name == "reward_accuracy"
    tok = result.model.tokenizer
    val = load_config({**cfg, "data": {**cfg["data"], "datasets": cfg["data"]["val_datasets"]}})
    batch = collate_items(pair_items(prepare_data(val, tok).train), tok.pad_token_id).batch
    ours = np.array(backends[1].sequence_scores(result.model, batch, grad=False))
    inputs = {"input_ids": torch.as_tensor(batch.input_ids), "attention_mask": torch.as_tensor(batch.attention_mask)}
    with torch.no_grad():
        whole = AutoModelForSequenceClassification.from_pretrained(str(result.output_dir)).eval()
        np.testing.assert_allclose(whole(**inputs).logits[:, 0].numpy(), ours, atol=TOL, rtol=0)
        base = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1,
                                                                  pad_token_id=tok.pad_token_id)
        peft = PeftModel.from_pretrained(base, str(result.output_dir / "adapter")).eval()
        np.testing.assert_allclose(peft(**inputs).logits[:, 0].numpy(), ours, atol=TOL, rtol=0)
    assert np.abs(ours).max() > 0
