"""GRPO on two processes (gloo, CPU, tiny model, fp32) against one process at the same global batch.

`mudpuppy run --nproc 2` at micro_batch_size 2 must be the run one process makes at micro_batch_size 4:
each rank samples the groups of its half of every generation batch (a group's seed does not depend
on the rank), the rollouts are gathered, every rank trains on its half of each shuffled micro-batch,
and the loss is divided by the units of both ranks (completions for grpo, the generation's loss
tokens for dapo). The per-step losses, the rewards, the held-out reward, the sampled completions and
the trained adapter must all agree at 1e-5; so must a two-process checkpoint taken in the middle of
a generation batch, resumed in one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mudpuppy.training import checkpoints

from ..conftest import QUICKSTART_DATA, tiny_run_config
from ..faults import kill_after
from ..training.test_grpo import grpo_config
from .test_torch_distributed import TOL, assert_same_adapter, launch, one_process

RL_TRAIN = QUICKSTART_DATA / "arithmetic_rl_train.jsonl"
RL_VAL = QUICKSTART_DATA / "arithmetic_rl_val.jsonl"


def config(tiny_config, out: Path, micro: int, loss_type: str, accumulation: int = 1, **grpo) -> dict:
    cfg = grpo_config(tiny_config, out, loss_type=loss_type, **grpo)
    cfg["data"] = {"datasets": [{"path": str(RL_TRAIN), "num_samples": 16}],
                   "val_datasets": [{"path": str(RL_VAL), "num_samples": 6}], "sequence_len": 64}
    # SGD: the gradients themselves are compared through the weights (see test_torch_distributed's DPO test).
    cfg["training"].update(max_steps=4, micro_batch_size=micro, gradient_accumulation_steps=accumulation,
                           optimizer="sgd", learning_rate=0.5, eval_steps=2)
    cfg["eval"] = {"before_training": False, "after_training": False, "batch_size": 4}
    return cfg


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def column(out: Path, key: str) -> list[float]:
    return [r[key] for r in rows(out) if key in r]


def completions(out: Path) -> list[tuple]:
    return [(r["step"], json.dumps(r["prompt"]), r["completion"])
            for r in map(json.loads, (out / "completions.jsonl").read_text().splitlines())]


CASES = {
    # Two optimizer steps per generation batch: old log-probs, and the KL to the reference (beta).
    "grpo": dict(loss_type="grpo", accumulation=1, steps_per_generation=2, beta=0.04),
    # Divided by the generation's loss tokens of both ranks; two passes over each generation batch;
    # advantages scaled by the std of the whole (gathered) generation batch.
    "dapo": dict(loss_type="dapo", accumulation=2, num_iterations=2, scale_rewards="batch"),
}


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """One process at micro batch 4, per case: the run two processes at micro batch 2 must equal."""
    made = {}

    def of(case: str) -> Path:
        if case not in made:
            out = tmp_path_factory.mktemp(f"one-{case}") / "one"
            one_process(config(tiny_run_config(tiny_model_dir, out), out, 4, **CASES[case]))
            made[case] = out
        return made[case]

    return of


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_processes_equal_one_at_the_same_global_batch(case, reference, tiny_config, tmp_path):
    done = launch(config(tiny_config, tmp_path / "two", 2, **CASES[case]), tmp_path / "two.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "launching 2 processes" in done.stdout and done.stdout.count("saved to") == 1
    one, two = reference(case), tmp_path / "two"
    assert len(column(two, "loss")) == 4
    np.testing.assert_allclose(column(two, "loss"), column(one, "loss"), atol=TOL, rtol=0)
    assert len(column(two, "reward")) == 2                      # two generation batches, logged once
    np.testing.assert_allclose(column(two, "reward"), column(one, "reward"), atol=TOL, rtol=0)
    for key in ("reward_std", "frac_reward_zero_std", "completions/mean_length", "rewards/exact_match/mean"):
        np.testing.assert_allclose(column(two, key), column(one, key), atol=TOL, rtol=0, err_msg=key)
    np.testing.assert_allclose(column(two, "eval_reward"), column(one, "eval_reward"), atol=TOL, rtol=0)
    assert len(column(two, "eval_reward")) == 2
    assert completions(two) == completions(one)                 # the same completions, written once
    assert_same_adapter(one, two)
    assert abs(column(one, "loss")[0]) > 1e-4                   # there was something to learn from


@pytest.mark.mlx
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_mlx_processes_equal_one(case, tiny_config, tmp_path):
    """The same on MLX's ring backend: the shared rollout code, MLX's per-seed sampling streams."""
    pytest.importorskip("mlx.core")
    from mudpuppy import create_backend, load_config, run

    cfgs = {}
    for name, micro in (("one", 4), ("two", 2)):
        cfgs[name] = config(tiny_config, tmp_path / name, micro, **CASES[case])
        cfgs[name]["backend"] = "mlx"
    run(load_config(cfgs["one"]), create_backend("mlx"), echo=lambda *_: None)
    done = launch(cfgs["two"], tmp_path / "two.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mx.distributed, ring backend" in done.stdout
    one, two = tmp_path / "one", tmp_path / "two"
    for key in ("loss", "reward", "eval_reward"):
        assert len(column(two, key)) == len(column(one, key)) > 0, key
        np.testing.assert_allclose(column(two, key), column(one, key), atol=TOL, rtol=0, err_msg=key)
    assert completions(two) == completions(one)
    assert_same_adapter(one, two)


def test_a_two_process_checkpoint_inside_a_generation_resumes_in_one_process(reference, tiny_config, tmp_path):
    """Killed after step 3 of a run whose generation batches last two steps: the checkpoint holds both
    ranks' micro-batches of the generation in progress (old and reference log-probs included), and one
    process at micro batch 4 continues where the two would have."""
    reference = reference("grpo")
    out = tmp_path / "broken"
    cfg = config(tiny_config, out, 2, **CASES["grpo"])
    cfg["training"]["save_steps"] = 1
    killed = launch(cfg, tmp_path / "broken.yaml", env=kill_after(3))
    assert killed.returncode != 0
    saved = checkpoints.list_checkpoints(out)[-1]
    assert saved.name == "step-00000003"
    buffer = json.loads((saved / checkpoints.STATE).read_text())["batcher"]["buffer"]
    # The generation's second micro-batch, still to be trained on: both ranks' halves, joined.
    assert len(buffer) == 2 and all(len(m["advantages"]["values"]) == 4 for m in buffer)

    cfg["training"]["micro_batch_size"] = 4
    cfg["resume"] = True
    result = one_process(cfg)
    assert result.resumed_from == 3
    np.testing.assert_allclose(column(out, "loss"), column(reference, "loss"), atol=TOL, rtol=0)
    np.testing.assert_allclose(column(out, "reward"), column(reference, "reward"), atol=TOL, rtol=0)
    assert completions(out) == completions(reference)
    assert_same_adapter(reference, out)


def test_a_group_samples_the_same_whatever_shares_its_batch(tiny_model_dir):
    """What makes a group's completions independent of its rank: rows that share a seed draw from a
    stream of their own, the same ids as those rows sampled alone with that seed (and a seed shared by
    the whole batch is the int seed's draw, transformers' own sampling)."""
    from mudpuppy import create_backend
    from mudpuppy.backends.protocol import Sampling
    from mudpuppy.config import ModelConfig

    backend = create_backend("cpu")
    handle = backend.load_model(ModelConfig(base_model=str(tiny_model_dir)), "fp32")
    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [10, 11, 12, 13], [10, 11, 12, 13]]
    for sampling in (Sampling(), Sampling(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01)):
        assert backend.sample(handle, prompts, 10, [0], sampling, seed=[7] * 5) == \
            backend.sample(handle, prompts, 10, [0], sampling, seed=7)
        together = backend.sample(handle, prompts, 10, [0], sampling, seed=[1, 1, 2, 3, 3])
        assert together[0] != together[1]                     # one stream: two draws, not one twice
        assert together[:2] == backend.sample(handle, prompts[:2], 10, [0], sampling, seed=1)
        assert together[2:3] == backend.sample(handle, prompts[2:3], 10, [0], sampling, seed=2)
        assert together[3:] == backend.sample(handle, prompts[3:], 10, [0], sampling, seed=[3, 3])


def test_grpo_under_fsdp_is_refused_with_the_way_out(tiny_config, tmp_path):
    cfg = config(tiny_config, tmp_path / "fsdp", 2, **CASES["grpo"])
    cfg["distributed"] = {"strategy": "fsdp"}
    done = launch(cfg, tmp_path / "fsdp.yaml")
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "GRPO samples a different number of tokens on each rank" in errors[0], done.stderr
    assert "strategy: ddp" in errors[0]


def test_a_micro_batch_split_over_ranks_joins_back():
    from mudpuppy.training.rollout import completion_batch, join_micro, split_micro
    from mudpuppy.training.grpo_loss import RolloutBatch

    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 50, size=n)) for n in (3, 5, 2, 4)]
    completions_ = [list(rng.integers(3, 50, size=n)) for n in (4, 1, 6, 2)]
    parts = []
    for lo in (0, 2):
        batch = completion_batch(prompts[lo:lo + 2], completions_[lo:lo + 2], [True, True], 0)
        rows = np.nonzero(batch.labels != -100)[0]
        logps = rng.normal(size=len(rows)).astype(np.float32)
        parts.append(RolloutBatch(batch, rng.normal(size=2).astype(np.float32), rows, logps, -logps, 1.5))
    joined = join_micro(parts, 0)
    assert joined.size == 4 and joined.dapo_count == 3.0
    for rank, part in enumerate(parts):
        back = split_micro(joined, rank, 2)
        for name in ("input_ids", "labels", "attention_mask"):
            np.testing.assert_array_equal(getattr(back.batch, name), getattr(part.batch, name))
        for name in ("advantages", "rows", "old_logps", "ref_logps"):
            np.testing.assert_array_equal(getattr(back, name), getattr(part, name))
        assert back.dapo_count == part.dapo_count
