"""torch-CPU and MLX agree: logits, PEFT adapters, and losses step by step (tiny model, fp32)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core")

from mudpuppy import load_config
from mudpuppy.backends import adapters as fmt
from mudpuppy.data import Batch, collate, collate_packed, prepare_sft_data
from mudpuppy.training.schedule import learning_rate

from .conftest import make_peft_adapter, model_cfg, random_batch, training_batches

pytestmark = pytest.mark.mlx

LOGITS_TOL = 1e-4
LOSS_TOL = 1e-3


def test_same_weights_same_logits(tiny_model_dir, torch_backend, mlx_backend):
    th = torch_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    mh = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    batch = random_batch(len(th.tokenizer))
    torch_logits, mlx_logits = torch_backend.logits(th, batch), mlx_backend.logits(mh, batch)
    assert torch_logits.shape == mlx_logits.shape
    # Every position, padding included: MLX gets the same padding mask as torch.
    assert np.abs(torch_logits - mlx_logits).max() < LOGITS_TOL
    torch_loss, mlx_loss = torch_backend.evaluate_loss(th, [batch]), mlx_backend.evaluate_loss(mh, [batch])
    assert torch_loss[1] == mlx_loss[1] and abs(torch_loss[0] - mlx_loss[0]) / torch_loss[1] < 1e-5


@pytest.mark.parametrize("dora, rslora", [(False, False), (True, True)], ids=["lora", "dora-rslora"])
def test_a_peft_adapter_gives_the_same_logits_on_mlx(tiny_model_dir, mlx_backend, tmp_path, dora, rslora):
    import torch
    from mlx_lm.utils import load_adapters
    from mlx_lm.utils import load_model as mlx_lm_load

    peft_model = make_peft_adapter(tiny_model_dir, tmp_path / "peft", dora=dora, rslora=rslora)
    batch = random_batch(320)
    with torch.no_grad():
        expected = peft_model(input_ids=torch.as_tensor(batch.input_ids),
                              attention_mask=torch.as_tensor(batch.attention_mask)).logits.numpy()
    fmt.convert_adapter(tmp_path / "peft", tmp_path / "mlx", "mlx")
    for source in ("peft", "mlx"):  # load_adapter takes either layout
        mh = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
        mlx_backend.load_adapter(mh, str(tmp_path / source))
        assert np.abs(mlx_backend.logits(mh, batch) - expected).max() < LOGITS_TOL
    # mlx-lm's own loader reads the converted copy to the same numbers (real tokens: it has no padding mask).
    import mlx.core as mx

    model, _ = mlx_lm_load(tiny_model_dir)
    load_adapters(model, str(tmp_path / "mlx"))
    plain = np.array(model(mx.array(batch.input_ids[:1])))
    assert np.abs(plain - expected[:1]).max() < LOGITS_TOL


def _paired_run(tiny_config, torch_backend, mlx_backend, tmp_path, adapter: dict, training: dict):
    """10 steps of 2 micro-batches each on both backends from identical weights and adapter init."""
    tiny_config["adapter"] = adapter
    tiny_config["training"].update(weight_decay=0.01, micro_batch_size=2, gradient_accumulation_steps=2, max_steps=10,
                                   warmup_steps=2,
                                   **training)
    cfg = load_config(tiny_config)
    torch_backend.seed(cfg.training.seed)
    th = torch_backend.load_model(cfg.model, "fp32")
    torch_backend.attach_adapter(th, cfg.adapter)
    mh = mlx_backend.load_model(cfg.model, "fp32")
    if adapter["type"] == "none":
        mlx_backend.attach_adapter(mh, cfg.adapter)
    else:
        # The torch LoRA init (A kaiming-uniform from torch's RNG, B zero), carried over as a PEFT adapter.
        torch_backend.save_adapter(th, str(tmp_path / "init"))
        mlx_backend.load_adapter(mh, str(tmp_path / "init"), trainable=True)
    batches = training_batches(cfg, th.tokenizer, steps=10, accumulation=2)
    torch_trainer = torch_backend.create_trainer(th, cfg.training)
    mlx_trainer = mlx_backend.create_trainer(mh, cfg.training)
    rows = []
    for step, micro in enumerate(batches):
        lr_now = learning_rate(cfg.training, step, 10)
        rows.append((torch_trainer.step(micro, lr_now), mlx_trainer.step(micro, lr_now)))
    return rows


LORA = {"type": "lora", "r": 4, "alpha": 8}


@pytest.mark.parametrize("adapter, training", [
    (LORA, {"optimizer": "sgd", "learning_rate": 0.5}),
    (LORA, {"optimizer": "sgd", "momentum": 0.9, "learning_rate": 0.3}),
    (LORA, {"optimizer": "adamw", "learning_rate": 5e-3}),
    (LORA, {"optimizer": "adafactor", "learning_rate": 1e-2}),
    ({**LORA, "type": "dora", "rslora": True, "target_modules": ["q_proj", "o_proj", "down_proj"]},
     {"optimizer": "adamw", "learning_rate": 5e-3}),
    ({"type": "none"}, {"optimizer": "adamw", "learning_rate": 1e-3}),
], ids=["lora-sgd", "lora-sgd-momentum", "lora-adamw", "lora-adafactor", "dora-rslora-adamw", "full-adamw"])
def test_ten_steps_give_the_same_losses(tiny_config, torch_backend, mlx_backend, tmp_path, adapter, training):
    rows = _paired_run(tiny_config, torch_backend, mlx_backend, tmp_path, adapter, training)
    worst = max(abs(t.loss - m.loss) for t, m in rows)
    assert worst < LOSS_TOL, [(t.loss, m.loss) for t, m in rows]
    assert all(t.loss_tokens == m.loss_tokens and t.tokens == m.tokens for t, m in rows)
    assert all(abs(t.grad_norm - m.grad_norm) < 1e-3 * max(1.0, t.grad_norm) for t, m in rows)
    assert not any(t.skipped or m.skipped for t, m in rows)  # ten real updates, not ten no-ops


def test_packed_rows_are_exact_and_never_mix(tiny_config, torch_backend, mlx_backend):
    cfg = load_config(tiny_config)
    mh = mlx_backend.load_model(cfg.model, "fp32")
    th = torch_backend.load_model(cfg.model, "fp32")
    examples = prepare_sft_data(cfg, mh.tokenizer).train[:5]
    pad = mh.tokenizer.pad_token_id
    packed = collate_packed([examples[:3], examples[3:]], pad)
    logits = mlx_backend.logits(mh, packed)
    for row, group in enumerate((examples[:3], examples[3:])):
        at = 0
        for ex in group:
            alone = mlx_backend.logits(mh, collate([ex], pad))[0]
            assert np.abs(logits[row, at : at + len(ex)] - alone).max() < LOGITS_TOL
            at += len(ex)
    # The packed loss is the sum of the examples' losses, on both backends.
    separate = sum(mlx_backend.evaluate_loss(mh, [collate([ex], pad)])[0] for ex in examples)
    assert mlx_backend.evaluate_loss(mh, [packed])[0] == pytest.approx(separate, rel=1e-5)
    assert torch_backend.evaluate_loss(th, [packed])[0] == pytest.approx(separate, rel=1e-5)


def test_dora_dropout_follows_peft_term_by_term(tiny_model_dir, mlx_backend, tmp_path):
    """With dropout on, PEFT drops out only the low-rank input and the base correction (mlx-lm's
    DoRA drops the whole update). The same dropout mask on both sides gives the same outputs."""
    import mlx.core as mx
    import torch

    peft_model = make_peft_adapter(tiny_model_dir, tmp_path / "peft", dora=True, targets=("down_proj",))
    keep = (np.random.default_rng(0).random((1, 12, 64)) > 0.3).astype(np.float32) / 0.7
    torch_mask = torch.as_tensor(keep)
    for layer in peft_model.base_model.model.model.layers:
        layer.mlp.down_proj.lora_dropout["default"] = _Mask(torch_mask)
    peft_model.train()
    batch = Batch(np.arange(3, 15)[None], np.full((1, 12), -100), np.ones((1, 12), dtype=np.int64))
    with torch.no_grad():
        expected = peft_model(input_ids=torch.as_tensor(batch.input_ids)).logits.numpy()
    mh = mlx_backend.load_model(model_cfg(tiny_model_dir), "fp32")
    mlx_backend.load_adapter(mh, str(tmp_path / "peft"))
    for layer in mh.model.layers:
        layer.mlp.down_proj.dropout = lambda x: x * mx.array(keep)
    mh.model.train()
    got = np.array(mh.model(mx.array(batch.input_ids)))
    assert np.abs(got - expected).max() < LOGITS_TOL


class _Mask:
    """A dropout stand-in with a fixed mask (a torch module, built lazily to keep imports local)."""

    def __new__(cls, mask):
        import torch

        class FixedDropout(torch.nn.Module):
            def forward(self, x):
                return x * mask

        return FixedDropout()
