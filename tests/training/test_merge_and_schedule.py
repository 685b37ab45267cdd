"""Merging adapters into the base, and the learning-rate schedules."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from mudpuppy import create_backend, load_config, run
from mudpuppy.cli import main
from mudpuppy.config import TrainingConfig
from mudpuppy.training.schedule import learning_rate

PROMPT = "<|im_start|>user\nturn on the kitchen lights<|im_end|>\n<|im_start|>assistant\n"


def logits_of(model, tokenizer):
    import torch

    ids = torch.tensor([tokenizer(PROMPT, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float().numpy()


@pytest.mark.parametrize("adapter", ["lora", "dora"])
def test_merged_model_matches_the_adapter_and_differs_from_base(tiny_config, tiny_model_dir, tmp_path, adapter):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny_config["adapter"] = {"type": adapter, "r": 4, "alpha": 8}
    tiny_config["training"].update(max_steps=4, learning_rate=3e-2)
    tiny_config["eval"] = {"before_training": False, "after_training": False}
    tiny_config["merge"] = True
    tiny_config["merge_dtype"] = "float32"
    result = run(load_config(tiny_config), create_backend("cpu"), echo=lambda *_: None)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))

    from peft import PeftModel
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with_adapter = logits_of(PeftModel.from_pretrained(base, str(result.output_dir)), tok)
    merged = logits_of(AutoModelForCausalLM.from_pretrained(str(result.output_dir / "merged")), tok)
    untouched = logits_of(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), tok)
    np.testing.assert_allclose(merged, with_adapter, atol=1e-5, rtol=0)
    assert np.abs(merged - untouched).max() > 1e-3


def trained_then_merged(tiny_config, tmp_path, steps: int):
    """`mudpuppy run` of the tiny config for `steps` steps, then `mudpuppy merge --dtype float32`; the runner,
    the config's path and the merge's result."""
    tiny_config["training"]["max_steps"] = steps
    tiny_config["eval"] = {"before_training": False, "after_training": False}
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_config))
    runner = CliRunner()
    assert runner.invoke(main, ["run", "-c", str(cfg_path)]).exit_code == 0
    merged = runner.invoke(main, ["merge", "-c", str(cfg_path), "--dtype", "float32"])
    assert merged.exit_code == 0, merged.output
    return runner, cfg_path


def test_merge_command_is_idempotent_and_protects_its_output(tiny_config, tmp_path):
    from safetensors.numpy import load_file

    runner, cfg_path = trained_then_merged(tiny_config, tmp_path, steps=2)
    merged = tmp_path / "run" / "merged" / "model.safetensors"
    weights = load_file(str(merged))
    again = runner.invoke(main, ["merge", "-c", str(cfg_path), "--dtype", "float32"])
    assert again.exit_code == 2 and "--overwrite" in again.output
    forced = runner.invoke(main, ["merge", "-c", str(cfg_path), "--dtype", "float32", "--overwrite"])
    assert forced.exit_code == 0
    for key, value in load_file(str(merged)).items():
        np.testing.assert_array_equal(value, weights[key])
    # merging what is already merged changes nothing
    from mudpuppy.backends.torch.model.merge import merge_adapter
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(merged.parent))
    assert merge_adapter(plain) is plain


def test_a_merged_model_carries_a_card_and_its_base(tiny_config, tmp_path):
    """`merge` writes the card and export.json `export --format merged` writes: the card says what made it
    and names the base; a later export of the merged model still knows its base and the fine-tune."""
    import json

    from mudpuppy.export.source import resolve_source

    trained_then_merged(tiny_config, tmp_path, steps=1)
    out = tmp_path / "run" / "merged"
    card = (out / "README.md").read_text()
    assert "written by `mudpuppy merge`" in card and "## What was trained" in card
    record = json.loads((out / "export.json").read_text())
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert record["base"] == summary["base"] and record["source_kind"] == "run" and record["dtype"] == "float32"
    assert set(record["files"]) == {p.name for p in out.iterdir()}
    again = resolve_source(str(out))
    assert again.kind == "model" and again.base == summary["base"] and again.finetune == "run"


def test_merge_without_an_adapter_is_a_clear_error(tiny_config, tmp_path):
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_config))
    res = CliRunner().invoke(main, ["merge", "-c", str(cfg_path)])
    assert res.exit_code == 2 and "holds no adapter" in res.output


def sched(**kw):
    return TrainingConfig(learning_rate=1.0, **kw)


def test_warmup_then_cosine_to_floor():
    cfg = sched(lr_scheduler="cosine", warmup_steps=4, min_lr_ratio=0.1)
    lrs = [learning_rate(cfg, s, 14) for s in range(14)]
    assert lrs[:4] == [0.0, 0.25, 0.5, 0.75]
    assert lrs[4] == 1.0
    assert lrs[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 9 / 10)))
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


# transformers' schedulers as the oracle (TRL, Axolotl and LLaMA-Factory all step them once per
# optimizer update, update k at lr_lambda(k)); the floor maps to lr_end / min_lr_rate.
ORACLE = [
    ("cosine", dict(min_lr_ratio=0.0), "cosine", {}),
    ("cosine", dict(min_lr_ratio=0.1), "cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("linear", {}, "linear", {}),
    ("constant", {}, "constant_with_warmup", {}),
    ("polynomial", dict(lr_power=2.0, min_lr_ratio=0.05), "polynomial", {"power": 2.0, "lr_end": 0.05}),
    ("cosine_with_restarts", dict(lr_cycles=3), "cosine_with_restarts", {"num_cycles": 3}),
]


@pytest.mark.parametrize("warmup", [0, 1, 4])
@pytest.mark.parametrize("ours,kw,theirs,their_kw", ORACLE, ids=[o[2] + ("-floor" if o[1] else "") for o in ORACLE])
def test_every_schedule_equals_transformers_update_for_update(ours, kw, theirs, their_kw, warmup):
    import torch
    from transformers import get_scheduler

    total = 17
    cfg = sched(lr_scheduler=ours, warmup_steps=warmup, **kw)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sch = get_scheduler(theirs, opt, num_warmup_steps=warmup, num_training_steps=total, scheduler_specific_kwargs=their_kw)
    expected = []
    for _ in range(total):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        sch.step()
    assert [learning_rate(cfg, s, total) for s in range(total)] == pytest.approx(expected, abs=1e-12)
    if warmup:
        assert expected[0] == 0.0  # the convention issue 31 measured: the first update runs at lr 0


def test_linear_polynomial_constant():
    assert [learning_rate(sched(lr_scheduler="linear"), s, 4) for s in range(4)] == [1.0, 0.75, 0.5, 0.25]
    poly = sched(lr_scheduler="polynomial", lr_power=2.0)
    assert learning_rate(poly, 2, 4) == pytest.approx(0.25)
    assert {learning_rate(sched(lr_scheduler="constant", warmup_ratio=0.5), s, 4) for s in (2, 3)} == {1.0}


def test_cosine_with_restarts_returns_to_the_peak_each_cycle():
    cfg = sched(lr_scheduler="cosine_with_restarts", lr_cycles=2)
    lrs = [learning_rate(cfg, s, 8) for s in range(8)]
    assert lrs[0] == lrs[4] == 1.0
    assert lrs[3] < 0.2 and lrs[7] < 0.2
    assert lrs[1] == pytest.approx(lrs[5])


@pytest.mark.parametrize("optimizer", ["sgd", "adafactor"])
def test_other_optimizers_train(tiny_config, optimizer):
    tiny_config["training"].update(optimizer=optimizer, max_steps=12, lr_scheduler="constant",
                                   learning_rate=0.5 if optimizer == "sgd" else 3e-2, momentum=0.9 if optimizer == "sgd" else 0.0)
    tiny_config["data"]["datasets"][0]["num_samples"] = 8
    tiny_config["eval"] = {"before_training": False, "after_training": False}
    if optimizer == "adafactor":
        # Adafactor scales each step by the parameter's RMS, so a zero-initialised
        # LoRA B hardly moves: it is an optimizer for full fine-tuning.
        tiny_config["adapter"] = {"type": "none"}
    result = run(load_config(tiny_config), create_backend("cpu"), echo=lambda *_: None)
    assert np.mean(result.losses[-3:]) < np.mean(result.losses[:3]) * 0.9, result.losses


def test_the_merge_at_the_end_of_training_runs_on_the_host(tiny_config, monkeypatch):
    """`merge: true` loads the base again in fp32 while the trained model and optimizer still hold the device:
    on a GPU it would need the base's fp32 size again in GPU memory, so it runs on the host instead."""
    from pathlib import Path

    import torch
    from mudpuppy.backends.torch.backend import DevicePlan, TorchBackend
    from mudpuppy.training import merge as merge_mod

    used = []
    monkeypatch.setattr(merge_mod, "merge_run", lambda cfg, backend, *a, **k: used.append(backend) or Path("m"))
    gpu = TorchBackend(DevicePlan("cuda", torch.device("cuda", 0), torch.bfloat16, precision="bf16"))
    cpu = create_backend("cpu")
    assert cpu.host_backend() is cpu
    tiny_config["merge"] = True
    lines = []
    merge_mod.merge_at_end(load_config(tiny_config), gpu, Path("out"), lines.append)
    assert used[0].plan.device == torch.device("cpu") and used[0] is not gpu
    assert lines[0] == "merging on the host (cpu): the trained model still holds cuda:0"
    # QAT merges its float fine-tune (output_dir/trained) the same way, on the host
    args = []
    monkeypatch.setattr(merge_mod, "merge_run", lambda cfg, backend, *a, **k: args.append((backend, a)) or Path("m"))
    lines.clear()
    assert merge_mod.merge_at_end(load_config(tiny_config), gpu, Path("out"), lines.append, adapter=Path("out/trained"),
                                  what="merged float model")
    assert args[0][0] is not gpu and args[0][1][:2] == ("out/trained", "out/merged")
    assert lines[1] == "merged float model (bfloat16) saved to m"
