"""A run checkpointed on one runtime resumes on the other (torch <-> MLX) as the same run.

The oracle is the writer's own uninterrupted run: 2K steps on torch against K
on torch then K resumed on MLX (and MLX then torch), dropout 0 and fp32 so
that only the RNG streams, which do not carry, could tell the runtimes apart.
Per-step losses and the final adapters agree within 1e-4. What cannot carry
is refused with one message naming the checkpoint, before anything trains.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

pytest.importorskip("mlx.core")

from mudpuppy import create_backend, load_config, run
from mudpuppy.backends import portable_state
from mudpuppy.errors import MudpuppyError
from mudpuppy.training import checkpoints
from mudpuppy.training.loop import Interrupted

from ..faults import StopAfter, kill_after
from .test_grpo import grpo_config
from .test_preference_mlx import run_config as preference_config

pytestmark = pytest.mark.mlx
K = 5
TOL = 1e-4
RUNTIME = {"cpu": "torch", "mlx": "mlx"}


def quiet(*_):
    pass


def sft_config(tiny_config, out, **training) -> dict:
    cfg = json.loads(json.dumps(tiny_config))
    cfg["output_dir"] = str(out)
    cfg["adapter"] = {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0}
    cfg["training"].update({"max_steps": 2 * K, "save_steps": K, "micro_batch_size": 4, "lr_scheduler": "cosine",
                            "warmup_steps": 2, "precision": "fp32", **training})
    cfg["eval"] = {"before_training": False, "after_training": False}
    return cfg


def straight_and_moved(cfg: dict, first: str, second: str, tmp_path):
    """(the uninterrupted run on `first`, the run stopped after step K on `first` and resumed on `second`)."""
    straight = run(load_config({**cfg, "output_dir": str(tmp_path / "straight")}), create_backend(first), echo=quiet)
    moved_cfg = {**cfg, "output_dir": str(tmp_path / "moved")}
    with pytest.raises(Interrupted):
        run(load_config(moved_cfg), StopAfter(create_backend(first), K), echo=quiet)
    assert checkpoints.newest_checkpoint(tmp_path / "moved").name == f"step-{K:08d}"
    resumed = run(load_config({**moved_cfg, "resume": True}), create_backend(second), echo=quiet)
    return straight, resumed


def assert_same_run(straight, resumed, tmp_path):
    assert resumed.resumed_from == K and resumed.steps == 2 * K
    np.testing.assert_allclose(resumed.losses, straight.losses, atol=TOL, rtol=0)
    assert resumed.lrs == straight.lrs
    a = load_file(str(tmp_path / "straight" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "moved" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(b[key], a[key], atol=TOL, rtol=0, err_msg=key)
    # B starts at zero and moved well past the tolerance: two untrained adapters would prove nothing.
    assert max(np.abs(a[k]).max() for k in a if "lora_B" in k) > 5 * TOL


@pytest.mark.parametrize("first,second", [("cpu", "mlx"), ("mlx", "cpu")])
def test_sft_moves_between_runtimes_as_the_same_run(first, second, tiny_config, tmp_path, capfd):
    straight, resumed = straight_and_moved(sft_config(tiny_config, tmp_path), first, second, tmp_path)
    assert_same_run(straight, resumed, tmp_path)
    err = capfd.readouterr().err
    assert f"written by the {first} backend ({RUNTIME[first]}); resuming on {second}" in err
    assert "dropout and sampling draws will differ" in err
    record = json.loads((tmp_path / "moved" / "checkpoints" / f"step-{2 * K:08d}" / "portable_state.json").read_text())
    assert record["written_by"] == {"runtime": RUNTIME[second], "backend": second}


@pytest.mark.parametrize("first,second", [("cpu", "mlx"), ("mlx", "cpu")])
def test_dpo_moves_between_runtimes_as_the_same_run(first, second, tiny_model_dir, tmp_path):
    cfg = preference_config(tiny_model_dir, tmp_path, "dpo")
    cfg["training"].update(max_steps=2 * K, save_steps=K, learning_rate=5e-3)
    cfg["eval"] = {"before_training": False, "after_training": False}
    cfg["logging"] = {"progress_bar": False}
    straight, resumed = straight_and_moved(cfg, first, second, tmp_path)
    assert_same_run(straight, resumed, tmp_path)
    # DPO's own measures (rewards of chosen and rejected, margins) after the move too.
    rows = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("straight", "moved")}
    for a, b in zip(rows["straight"], rows["moved"], strict=True):
        for key in ("reward_chosen", "reward_rejected", "reward_margin"):
            assert abs(a[key] - b[key]) < TOL, (key, a["step"], a[key], b[key])


def rollout_rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("first,second", [("cpu", "mlx"), ("mlx", "cpu")])
def test_grpo_moves_between_runtimes_with_its_rollouts(first, second, tiny_config, tmp_path):
    """One generation batch (sampled on `first`) serves steps 1-8, so the checkpoint after step K carries
    rollouts, their old and reference log-probs, and the generation's position: steps K+1..8 on `second`
    train on exactly those, as the uninterrupted run does. Step 9 samples again, on `second`: the same
    prompts (the data position carried), drawn from another runtime's random stream."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {a} plus {a + 3}? Answer with a number.",
                                           "answer": str(2 * a + 3)}) + "\n" for a in range(12)))
    cfg = grpo_config(tiny_config, tmp_path / "unused", steps_per_generation=8, beta=0.04)
    cfg["data"]["datasets"] = [{"path": str(prompts)}]
    cfg["training"].update(max_steps=2 * K, save_steps=K, precision="fp32", learning_rate=2e-2)
    straight, resumed = straight_and_moved(cfg, first, second, tmp_path)
    assert resumed.resumed_from == K and resumed.steps == 2 * K
    np.testing.assert_allclose(resumed.losses[:8], straight.losses[:8], atol=TOL, rtol=0)
    assert all(np.isfinite(resumed.losses))
    a, b = rollout_rows(tmp_path / "straight"), rollout_rows(tmp_path / "moved")
    assert [r["step"] for r in b] == [r["step"] for r in a]
    first_generation = [r for r in a if r["step"] == 1]
    assert [(r["completion"], r["rewards"]) for r in b if r["step"] == 1] == \
        [(r["completion"], r["rewards"]) for r in first_generation]
    assert [r["prompt"] for r in b if r["step"] == 9] == [r["prompt"] for r in a if r["step"] == 9]
    metrics = [json.loads(line) for line in (tmp_path / "moved" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward" in m] == [1, 9]


def stopped_run(cfg: dict, backend: str):
    """The run of `cfg` stopped after step K on `backend`; its checkpoint of step K."""
    with pytest.raises(Interrupted):
        run(load_config(cfg), StopAfter(create_backend(backend), K), echo=quiet)
    return checkpoints.newest_checkpoint(cfg["output_dir"])


def assert_refused_untouched(cfg: dict, backend: str, ckpt, match: str):
    before = (ckpt.parent.parent / "metrics.jsonl").read_text()
    with pytest.raises(MudpuppyError, match=match) as info:
        run(load_config({**cfg, "resume": True}), create_backend(backend), echo=quiet)
    assert str(ckpt) in str(info.value)
    assert (ckpt.parent.parent / "metrics.jsonl").read_text() == before         # nothing trained
    assert [c.name for c in checkpoints.list_checkpoints(ckpt.parent.parent)] == [ckpt.name]


def test_a_qlora_checkpoint_is_refused_on_the_other_runtime_before_training(tiny_config, tmp_path):
    cfg = sft_config(tiny_config, tmp_path / "run")
    cfg["adapter"].update(type="qlora", quant_backend="mxfp4")
    ckpt = stopped_run(cfg, "cpu")
    assert_refused_untouched(cfg, "mlx", ckpt, r"cannot resume checkpoint .* on the mlx backend \(mlx\): "
                                               r"adapter.type qlora: the frozen base was quantized .*--backend cpu")


def test_another_optimizer_is_refused_naming_both(tiny_config, tmp_path):
    cfg = sft_config(tiny_config, tmp_path / "run", optimizer="sgd", momentum=0.9)
    ckpt = stopped_run(cfg, "mlx")
    cfg["training"]["optimizer"] = "adamw"
    # refused before the model loads, from what the checkpoint records it was trained with (resume_changes.py)
    assert_refused_untouched(cfg, "cpu", ckpt, 'optimizer state belong .*\n  training.optimizer: "sgd" -> "adamw"')
    # a checkpoint that records nothing (and no config.yaml beside it): the backend's check of the state itself
    marker = json.loads((ckpt / checkpoints.MARKER).read_text())
    del marker["trained_with"]
    (ckpt / checkpoints.MARKER).write_text(json.dumps(marker))
    (ckpt.parent.parent / "config.yaml").unlink()
    assert_refused_untouched(cfg, "cpu", ckpt, "its optimizer state is sgd's and this config's training.optimizer "
                                               "is adamw")


def make_old_format(ckpt) -> None:
    """A checkpoint as mudpuppy wrote it before the portable state: those files gone from it and its marker."""
    marker = json.loads((ckpt / checkpoints.MARKER).read_text())
    for name in (portable_state.JSON_FILE, portable_state.TENSOR_FILE):
        (ckpt / name).unlink()
        del marker["files"][name]
    (ckpt / checkpoints.MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize("writer,other,hint", [("cpu", "mlx", "cpu, cuda or rocm"), ("mlx", "cpu", "mlx")])
def test_an_old_checkpoint_resumes_where_it_was_written_only(writer, other, hint, tiny_config, tmp_path):
    cfg = sft_config(tiny_config, tmp_path / "run")
    ckpt = stopped_run(cfg, writer)
    make_old_format(ckpt)
    assert_refused_untouched(cfg, other, ckpt, f"written by the {RUNTIME[writer]} runtime before mudpuppy kept a "
                                               f"runtime-neutral copy .* --backend {hint}")
    straight = run(load_config(sft_config(tiny_config, tmp_path / "straight")), create_backend(writer), echo=quiet)
    resumed = run(load_config({**cfg, "resume": True}), create_backend(writer), echo=quiet)
    assert resumed.losses == straight.losses                      # the writer's own files: bit for bit


@pytest.mark.parametrize("optimizer", ["sgd", "adafactor"])
def test_sgd_and_adafactor_state_move_too(optimizer, tiny_config, tmp_path):
    """Momentum buffers, and adafactor's factored second moments, whose factors swap where MLX holds a
    matrix transposed (LoRA A and B)."""
    extra = {"momentum": 0.9, "learning_rate": 2.0} if optimizer == "sgd" else {"learning_rate": 0.1}
    cfg = sft_config(tiny_config, tmp_path, optimizer=optimizer, **extra)
    cfg["adapter"]["type"] = "dora"
    straight, resumed = straight_and_moved(cfg, "cpu", "mlx", tmp_path)
    assert_same_run(straight, resumed, tmp_path)


def test_a_dcp_checkpoint_of_two_torch_processes_resumes_in_one_mlx_process(tiny_config, tmp_path):
    """FSDP2 shards the adapter and its moments over two processes; the checkpoint also holds them gathered
    (rank 0 writes the portable state), which is what MLX, with no torch.distributed, reads."""
    from ..distributed.test_torch_distributed import launch

    cfg = sft_config(tiny_config, tmp_path / "moved", micro_batch_size=2)
    cfg["distributed"] = {"strategy": "fsdp"}
    killed = launch(cfg, tmp_path / "moved.yaml", env=kill_after(K))
    assert killed.returncode != 0
    ckpt = checkpoints.newest_checkpoint(tmp_path / "moved")
    assert ckpt.name == f"step-{K:08d}" and (ckpt / "sharded" / ".metadata").is_file()
    assert not (ckpt / "trainable.safetensors").exists()

    straight = run(load_config(sft_config(tiny_config, tmp_path / "straight")), create_backend("cpu"), echo=quiet)
    cfg.pop("distributed")
    cfg["training"]["micro_batch_size"] = 4          # one process at the same global batch
    resumed = run(load_config({**cfg, "resume": True}), create_backend("mlx"), echo=quiet)
    assert_same_run(straight, resumed, tmp_path)


def test_a_full_fine_tune_moves_under_the_models_own_names(tiny_config, tmp_path):
    cfg = sft_config(tiny_config, tmp_path, learning_rate=1e-3)
    cfg["adapter"] = {"type": "none"}
    straight, resumed = straight_and_moved(cfg, "mlx", "cpu", tmp_path)
    np.testing.assert_allclose(resumed.losses, straight.losses, atol=TOL, rtol=0)
    record = json.loads((tmp_path / "moved" / "checkpoints" / f"step-{K:08d}" / "portable_state.json").read_text())
    assert "model.layers.0.self_attn.q_proj.weight" in record["tensors"]
    assert not any(name.startswith("base_model") for name in record["tensors"])
