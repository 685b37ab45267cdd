"""The preference losses, written once, on MLX and on torch: same model, adapter and batch, within 1e-4.

Each objective is evaluated on both backends (value and every logged
metric), then trained three AdamW steps on both from the same adapter: the
losses after each update agree only if the gradients did.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core")

from mudpuppy import create_backend, load_config
from mudpuppy.config import PreferenceConfig
from mudpuppy.data import prepare_data
from mudpuppy.data.pairs import collate_items, kto_items, pair_items
from mudpuppy.training.preference import PreferenceObjective, precompute_reference

from ..conftest import QUICKSTART_DATA, randomize_lora

pytestmark = pytest.mark.mlx
TOL = 1e-4
TYPES = {"dpo": {"beta": 0.5, "label_smoothing": 0.1}, "ipo": {"beta": 0.5}, "simpo": {"beta": 2.0, "gamma": 0.5},
         "orpo": {"orpo_lambda": 0.3}, "kto": {"beta": 0.5, "desirable_weight": 1.2, "undesirable_weight": 0.8}}


@pytest.fixture(scope="module")
def backends():
    return create_backend("cpu"), create_backend("mlx")


def run_config(tiny_model_dir, tmp_path, kind: str) -> dict:
    data = "smart_home_kto" if kind == "kto" else "smart_home_pref"
    return {"model": {"base_model": str(tiny_model_dir)}, "method": "preference",
            "preference": {"type": kind, **TYPES[kind]},
            "adapter": {"type": "lora", "r": 4, "alpha": 8},
            "data": {"datasets": [{"path": str(QUICKSTART_DATA / f"{data}_train.jsonl"), "num_samples": 8}],
                     "sequence_len": 128, "cache": False},
            "training": {"max_steps": 3, "micro_batch_size": 4, "learning_rate": 2e-2, "precision": "fp32",
                         "seed": 5, "lr_scheduler": "constant"},
            "output_dir": str(tmp_path / "unused")}


def prepared_items(cfg, tokenizer, kind: str):
    examples = prepare_data(cfg, tokenizer).train
    items = kto_items(examples, cfg.data.sequence_len) if kind == "kto" else pair_items(examples)
    return [collate_items(items[i : i + 4], tokenizer.pad_token_id) for i in range(0, len(items), 4)]


def same_adapter(backends, cfg, tmp_path, head=None):
    """Both runtimes on the tiny model with one PEFT adapter whose B is random (policy != reference);
    with `head`, the scalar head (saved with the adapter) is shared too."""
    torch_backend, mlx_backend = backends
    torch_backend.seed(cfg.training.seed)
    th = torch_backend.load_model(cfg.model, "fp32", head=head)
    torch_backend.attach_adapter(th, cfg.adapter)
    randomize_lora(th.model, seed=0, scale=0.3)
    torch_backend.save_adapter(th, str(tmp_path / "adapter"))
    mh = mlx_backend.load_model(cfg.model, "fp32", head=head)
    mlx_backend.load_adapter(mh, str(tmp_path / "adapter"), trainable=True)
    return th, mh


def assert_objectives_agree(backends, objectives, handles, batch) -> dict:
    """One objective on torch and on MLX, without gradient: the same value and metrics within TOL.
    Returns torch's metrics."""
    (torch_backend, mlx_backend), (t_obj, m_obj), (th, mh) = backends, objectives, handles
    t_loss, t_metrics = t_obj(th, batch, grad=False)
    m_loss, m_metrics = m_obj(mh, batch, grad=False)
    assert abs(torch_backend.ops.to_float(t_loss) - mlx_backend.ops.to_float(m_loss)) < TOL
    assert t_metrics.keys() == m_metrics.keys()
    for key in t_metrics:
        assert m_metrics[key] == pytest.approx(t_metrics[key], abs=TOL), key
    return t_metrics


@pytest.mark.parametrize("kind", list(TYPES))
def test_objective_values_and_training_agree_with_torch(kind, backends, tiny_model_dir, tmp_path):
    torch_backend, mlx_backend = backends
    cfg = load_config(run_config(tiny_model_dir, tmp_path, kind))
    th, mh = same_adapter(backends, cfg, tmp_path)
    batches = prepared_items(cfg, th.tokenizer, kind)
    pref = PreferenceConfig(type=kind, **TYPES[kind])
    t_obj, m_obj = PreferenceObjective(torch_backend, pref), PreferenceObjective(mlx_backend, pref)
    assert_objectives_agree(backends, (t_obj, m_obj), (th, mh), batches[0])

    t_trainer = torch_backend.create_trainer(th, cfg.training)
    m_trainer = mlx_backend.create_trainer(mh, cfg.training)
    for _ in range(3):
        t = t_trainer.step(batches, 2e-2, t_obj)
        m = m_trainer.step(batches, 2e-2, m_obj)
        assert t.loss_tokens == m.loss_tokens == sum(b.size for b in batches)
        assert abs(t.loss - m.loss) < TOL, (t.loss, m.loss)
        assert abs(t.grad_norm - m.grad_norm) < TOL * max(1.0, t.grad_norm)
        assert m.metrics["reward_accuracy"] == pytest.approx(t.metrics["reward_accuracy"], abs=TOL)


def test_precomputed_reference_agrees_with_torch(backends, tiny_model_dir, tmp_path):
    torch_backend, mlx_backend = backends
    cfg = load_config(run_config(tiny_model_dir, tmp_path, "kto"))
    th, mh = same_adapter(backends, cfg, tmp_path)
    examples = prepare_data(cfg, th.tokenizer).train
    items = kto_items(examples, cfg.data.sequence_len)
    t_ref = np.stack([it.ref_logps for it in precompute_reference(torch_backend, th, items, 3, 0)])
    m_ref = np.stack([it.ref_logps for it in precompute_reference(mlx_backend, mh, items, 3, 0)])
    assert np.abs(t_ref - m_ref).max() < TOL


def test_a_dpo_run_trains_on_mlx_through_the_recipe(tiny_model_dir, tmp_path):
    from mudpuppy import run

    cfg = run_config(tiny_model_dir, tmp_path, "dpo")
    cfg.update(backend="mlx", output_dir=str(tmp_path / "run"), logging={"progress_bar": False})
    cfg["data"]["val_datasets"] = [{"path": str(QUICKSTART_DATA / "smart_home_pref_val.jsonl"), "num_samples": 4}]
    result = run(load_config(cfg), echo=lambda *_: None)
    assert result.steps == 3 and result.after.accuracy is not None
    assert (result.output_dir / "adapter_model.safetensors").is_file()
