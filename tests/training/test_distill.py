"""method: distill through the recipe on torch: its config section, GKD's on-policy draw, the batcher's
prompts and resume state, a short run that lowers the divergence, and a curriculum SFT -> distill."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mudpuppy import load_config, load_curriculum, run
from mudpuppy.config import ConfigError
from mudpuppy.training.distill import batch_prompts, on_policy
from mudpuppy.training.rollout import completion_batch

from ..conftest import QUICKSTART_DATA, build_tiny_model
from .test_distill_oracle import distill_raw


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-teacher"), seed=7, hidden_size=48)


def quiet(*_):
    pass


def test_the_section_is_required_checked_and_refused_elsewhere(tiny_model_dir, teacher_dir, tmp_path):
    raw = distill_raw(tiny_model_dir, teacher_dir, tmp_path)
    cfg = load_config(raw)
    assert cfg.distill.loss == "jsd" and cfg.distill.trl_beta == 0.5 and cfg.data_method() == "sft"
    assert load_config({**raw, "distill": {"teacher": "t", "loss": "reverse_kl"}}, check_files=False).distill.trl_beta == 1.0
    del raw["distill"]
    with pytest.raises(ConfigError, match="distill: method distill needs a distill section naming the teacher"):
        load_config(raw)
    for bad, where in [({"lmbda": 1.5}, "distill.lmbda"), ({"beta": 1.0}, "distill.beta"), ({"loss": "kl"}, "distill.loss"),
                       ({"top_k": -1}, "distill.top_k")]:
        with pytest.raises(ConfigError, match=where):
            load_config({**raw, "distill": {"teacher": str(teacher_dir), **bad}})
    with pytest.raises(ConfigError, match="distill: this section applies to method: distill"):
        load_config({**raw, "method": "sft", "distill": {"teacher": str(teacher_dir)}})
    with pytest.raises(ConfigError, match="data.packing"):
        load_config({**raw, "distill": {"teacher": str(teacher_dir)}, "data": {**raw["data"], "packing": True}})


def test_the_on_policy_draw_is_lmbda_of_the_micro_batches_and_a_function_of_seed_and_index():
    draws = [on_policy(3, i, 0.3) for i in range(4000)]
    assert abs(np.mean(draws) - 0.3) < 0.03
    assert draws == [on_policy(3, i, 0.3) for i in range(4000)]
    assert not any(on_policy(3, i, 0.0) for i in range(100)) and all(on_policy(3, i, 1.0) for i in range(100))


def test_prompts_are_what_comes_before_the_first_loss_token():
    prompts, completions = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]]
    batch = completion_batch(prompts, completions, [True, True], pad_id=0)
    assert batch_prompts(batch) == prompts
    again = completion_batch(batch_prompts(batch), completions, [True, True], pad_id=0)
    np.testing.assert_array_equal(again.labels, batch.labels)


def run_config(tiny_model_dir, teacher_dir, out, **distill):
    raw = distill_raw(tiny_model_dir, teacher_dir, out, **{"lmbda": 0.5, "max_completion_length": 8, **distill})
    raw["output_dir"] = str(out / "run")
    raw["training"].update({"max_steps": 6, "learning_rate": 1e-2, "lr_scheduler": "constant"})
    raw["eval"] = {"before_training": False, "after_training": False}
    return raw


def test_a_run_mixes_on_and_off_policy_micro_batches_and_lowers_the_divergence(tiny_model_dir, teacher_dir, tmp_path):
    """Six steps of JSD at lmbda 0.5, two micro-batches a step: both kinds occur, the loss stays finite,
    and the sampled tokens are reported exactly for the steps that sampled."""
    raw = run_config(tiny_model_dir, teacher_dir, tmp_path, lmbda=0.5)
    raw["training"]["gradient_accumulation_steps"] = 2
    result = run(load_config(raw), echo=quiet)
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(math.isfinite(r["loss"]) and r["loss"] >= 0 for r in rows)
    shares = [r["on_policy"] for r in rows]
    assert all(s in (0.0, 0.5, 1.0) for s in shares) and 0 < np.mean(shares) < 1
    assert all(("completions/tokens" in r) == (r["on_policy"] > 0) for r in rows)


def test_an_off_policy_run_learns_the_teacher_on_a_fixed_batch(tiny_model_dir, teacher_dir, tmp_path):
    """lmbda 0 and the same examples every step: the forward KL falls by a clear margin."""
    raw = run_config(tiny_model_dir, teacher_dir, tmp_path, lmbda=0.0, loss="forward_kl")
    raw["data"]["datasets"][0]["num_samples"] = 4
    raw["training"].update({"max_steps": 8, "learning_rate": 3e-2})
    result = run(load_config(raw), echo=quiet)
    losses = [json.loads(line)["loss"] for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.8 * losses[0]
    assert all(json.loads(line)["on_policy"] == 0.0
               for line in (result.output_dir / "metrics.jsonl").read_text().splitlines())


def test_a_curriculum_chains_sft_then_distill(tiny_model_dir, teacher_dir, tmp_path):
    data = {"datasets": [{"path": str(QUICKSTART_DATA / "smart_home_train.jsonl"), "num_samples": 16}]}
    cur = load_curriculum({
        "model": {"base_model": str(tiny_model_dir)}, "adapter": {"type": "lora", "r": 4, "alpha": 8},
        "data": {"sequence_len": 128}, "training": {"max_steps": 1, "micro_batch_size": 4, "precision": "fp32"},
        "distill": {"teacher": str(teacher_dir), "loss": "reverse_kl"}, "output_dir": str(tmp_path / "c"),
        "stages": [{"name": "sft", "data": data}, {"name": "distill", "method": "distill", "data": data}]})
    sft, distill = cur.stages
    assert sft.cfg.distill is None and distill.cfg.distill.loss == "reverse_kl"
    assert distill.cfg.adapter.init_from == str(sft.dir)


def test_the_batcher_resumes_to_the_same_micro_batches(tiny_model_dir, teacher_dir, tmp_path):
    """A batcher restored from another's state_dict after 3 micro-batches makes the same next 4 (the
    on-policy draws and the samples included) as the one that went on."""
    from mudpuppy import create_backend
    from mudpuppy.data import Batcher, prepare_sft_data
    from mudpuppy.training.distill import DistillBatcher

    cfg = load_config(run_config(tiny_model_dir, teacher_dir, tmp_path, lmbda=0.5))
    backend = create_backend("cpu")
    handle = backend.load_model(cfg.model, "fp32")
    train = prepare_sft_data(cfg, handle.tokenizer).train

    def batcher():
        return DistillBatcher(cfg, backend, handle, Batcher.from_config(train, cfg, handle.tokenizer.pad_token_id))

    first = batcher()
    for _ in range(3):
        first.next_batch()
    second = batcher()
    second.load_state_dict(first.state_dict())
    kinds = []
    for _ in range(4):
        a, b = first.next_batch(), second.next_batch()
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.labels, b.labels)
        kinds.append(first.made[-1][0])
    assert kinds == [on_policy(cfg.training.seed, i, 0.5) for i in range(3, 7)] and True in kinds and False in kinds


def test_a_quantized_teacher_trains_the_student(tiny_model_dir, teacher_dir, tmp_path):
    """teacher_quantize: the teacher's linear layers as QLoRA's 4-bit codes; the run's divergence is close to
    the full-precision teacher's at the first step, not equal."""
    losses = []
    for quantize in (False, True):
        raw = run_config(tiny_model_dir, teacher_dir, tmp_path / str(quantize), lmbda=0.0, teacher_quantize=quantize)
        raw["training"]["max_steps"] = 2
        result = run(load_config(raw), echo=quiet)
        losses.append(json.loads((result.output_dir / "metrics.jsonl").read_text().splitlines()[0])["loss"])
    assert losses[0] != losses[1] and abs(losses[0] - losses[1]) < 0.2 * losses[0]
