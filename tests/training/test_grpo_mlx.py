"""GRPO's objective, written once, on MLX and on torch: same model, adapter and rollouts, within 1e-4.

The loss and its metrics are compared on fixed rollouts (off-policy old
log-probs so clipping acts, and a reference for the KL), then three AdamW
steps are taken on both from the same adapter: the losses after each update
agree only if the gradients did. A short GRPO run through the recipe on MLX
closes the loop (sampling, rewards, the shared training loop).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core")

from mudpuppy import load_config, run
from mudpuppy.config import GrpoConfig
from mudpuppy.training.grpo_loss import GrpoObjective, RolloutBatch
from mudpuppy.training.rollout import completion_batch

from .test_grpo import grpo_config
from .test_preference_mlx import assert_objectives_agree, backends, run_config, same_adapter  # noqa: F401

pytestmark = pytest.mark.mlx
TOL = 1e-4


def rollouts(torch_backend, th, temperature: float, every: int) -> list[RolloutBatch]:
    """Two micro-batches of completions of different lengths; old log-probs shifted so clipping acts."""
    rng = np.random.default_rng(0)
    out = []
    for m in range(2):
        prompts = [[5, 6, 7, 8]] * 4
        completions = [rng.integers(10, 200, n).tolist() for n in (3, 6, 2, 5)]
        batch = completion_batch(prompts, completions, [True, True, True, m == 0], pad_id=0)
        rows = np.nonzero(batch.labels != -100)[0]
        now, _ = torch_backend.token_logprobs(th, batch, grad=False, temperature=temperature)
        now = torch_backend.ops.to_numpy(now)
        advantages = np.array([1.2, -0.7, 0.4, -0.9], np.float32)
        # Old log-probs moved (every `every`-th token) so that the ratio leaves the clip range on the side
        # its advantage's sign clips; at sequence level every token moves, so the mean does too.
        moved = np.arange(len(rows)) % every == 0
        shift = (np.where(advantages[rows] > 0, -0.35, 0.35) * moved).astype(np.float32)
        ref, _ = torch_backend.token_logprobs(th, batch, grad=False, temperature=temperature, reference=True)
        out.append(RolloutBatch(batch, advantages, rows, now + shift,
                                torch_backend.ops.to_numpy(ref), dapo_count=float(len(rows)) * 1.5))
    return out


@pytest.mark.parametrize("loss_type,level", [("dapo", "token"), ("grpo", "sequence"), ("dr_grpo", "token"),
                                             ("bnpo", "sequence"), ("cispo", "token"), ("sapo", "sequence"),
                                             ("luspo", "sequence"), ("vespo", "token")])
def test_grpo_objective_and_training_agree_with_torch(loss_type, level, backends, tiny_model_dir, tmp_path):
    torch_backend, mlx_backend = backends
    cfg = load_config(run_config(tiny_model_dir, tmp_path, "dpo"))
    th, mh = same_adapter(backends, cfg, tmp_path)
    # cispo caps the ratio itself at epsilon_high: 1.2 caps the shifted tokens only.
    g = GrpoConfig(reward_funcs=["exact_match"], loss_type=loss_type, importance_sampling_level=level, beta=0.04,
                   temperature=0.9, epsilon_high=1.2 if loss_type == "cispo" else 0.28, max_completion_length=8)
    batches = rollouts(torch_backend, th, g.temperature, every=2 if level == "token" else 1)
    t_obj, m_obj = GrpoObjective(torch_backend, g), GrpoObjective(mlx_backend, g)
    t_metrics = assert_objectives_agree(backends, (t_obj, m_obj), (th, mh), batches[0])
    if loss_type == "cispo":
        assert 0 < t_metrics["cispo_clip_ratio"] < 1        # the shifted old log-probs really cap
    elif loss_type == "vespo":
        assert t_metrics["vespo/phi_seq_mean"] != pytest.approx(1.0, abs=1e-3)
    elif loss_type != "sapo":
        assert t_metrics["clip_ratio/region_mean"] > 0      # the shifted old log-probs really clip

    assert_steps_agree(backends, (th, mh), (t_obj, m_obj), batches, cfg.training, 2e-2)


def assert_steps_agree(backends, handles, objectives, batches, training, lr: float) -> None:
    """Three AdamW steps on both runtimes: the losses after each update agree only if the gradients did."""
    (torch_backend, mlx_backend), (th, mh), (t_obj, m_obj) = backends, handles, objectives
    t_trainer = torch_backend.create_trainer(th, training)
    m_trainer = mlx_backend.create_trainer(mh, training)
    for _ in range(3):
        t = t_trainer.step(batches, lr, t_obj)
        m = m_trainer.step(batches, lr, m_obj)
        assert abs(t.loss - m.loss) < TOL, (t.loss, m.loss)
        assert abs(t.grad_norm - m.grad_norm) < TOL * max(1.0, t.grad_norm)
        assert t.grad_norm > 0


def test_a_grpo_run_trains_on_mlx_through_the_recipe(tiny_config, tmp_path):
    run_two_steps_on_mlx(grpo_config(tiny_config, tmp_path / "run", beta=0.04))


def run_two_steps_on_mlx(cfg: dict):
    """Two steps of an online run's config on MLX: trained, saved, each generation's completions logged."""
    cfg.update(backend="mlx")
    cfg["training"].update(max_steps=2)
    result = run(load_config(cfg), echo=lambda *_: None)
    assert result.steps == 2
    assert (result.output_dir / "adapter_model.safetensors").is_file()
    assert (result.output_dir / "completions.jsonl").read_text().count("\n") == 2 * 4
    return result
