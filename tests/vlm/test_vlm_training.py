"""Vision-language SFT end to end on the tiny LLaVA: the CLI trains it, the adapter is plain PEFT and
reproduces mudpuppy's logits, the vision tower is frozen unless asked, and bad runs are refused before
anything is written."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from mudpuppy import create_backend, load_config, run
from mudpuppy.cli import main
from mudpuppy.data import collate, prepare_sft_data
from mudpuppy.data.images import load_image

from .conftest import image_record, vlm_config, write_jsonl

# transformers saves LLaVA under its original checkpoint names: vision_tower.*, language_model.*
VISION = "vision_tower."


def write_cfg(tmp_path, cfg) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def quiet(*_args, **_kwargs) -> None:
    pass


def test_cli_lora_run_learns_the_repeated_batch_and_saves_adapter_and_processor(tiny_vlm_dir, vlm_data, tmp_path):
    from transformers import AutoProcessor

    cfg = vlm_config(tiny_vlm_dir, vlm_data, tmp_path / "run")
    res = CliRunner().invoke(main, ["run", "--config", write_cfg(tmp_path, cfg)])
    assert res.exit_code == 0, res.output
    out = tmp_path / "run"
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    # 4 examples, micro batch 4, no shuffling: every step sees the same batch, and its loss falls.
    assert len(losses) == 8 and losses[-1] < 0.7 * losses[0]
    assert all(b < a for a, b in zip(losses, losses[1:]))
    # The adapter sits on the language model only; the processor is saved beside it.
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert tensors and all(".language_model." in k for k in tensors)
    assert AutoProcessor.from_pretrained(str(out)).image_token == "<image>"


def test_plain_peft_loads_the_adapter_and_gives_the_same_logits(any_vlm_dir, vlm_data, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    cfg = load_config(vlm_config(any_vlm_dir, vlm_data, tmp_path / "run", training={"max_steps": 4}))
    backend = create_backend("cpu")
    result = run(cfg, backend, echo=quiet)
    assert result.losses[-1] < result.losses[0]
    handle = result.model
    data = prepare_sft_data(cfg, handle.tokenizer)

    base = AutoModelForImageTextToText.from_pretrained(str(any_vlm_dir), dtype=torch.float32)
    plain = PeftModel.from_pretrained(base, str(result.output_dir)).eval()
    processor = AutoProcessor.from_pretrained(str(result.output_dir))
    for ex, record in zip(data.val, data.val_records):
        ours = backend.logits(handle, collate([ex], handle.tokenizer.pad_token_id))
        text = processor.apply_chat_template(as_template_messages(record), tokenize=False)
        inputs = processor(text=[text], images=[load_image(f) for f in ex.images], add_special_tokens=False,
                           return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == ex.input_ids.tolist()
        with torch.no_grad():
            theirs = plain(**inputs).logits.numpy()
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    # The adapter changed the model: the base alone gives other logits.
    with torch.no_grad(), plain.disable_adapter():
        untouched = plain(**inputs).logits.numpy()
    assert np.abs(untouched - theirs).max() > 1e-3


def as_template_messages(record: dict) -> list[dict]:
    """A record's messages as a user of transformers writes them for a processor's chat template."""
    return [{"role": m["role"], "content": [{"type": "image"} if p["type"] == "image" else p
                                            for p in m.get("parts", [{"type": "text", "text": m["content"]}])]}
            for m in record["messages"]]


@pytest.mark.parametrize("freeze", [True, False])
def test_lora_leaves_the_vision_tower_alone_unless_asked(tiny_vlm_dir, vlm_data, tmp_path, freeze):
    cfg = load_config(vlm_config(tiny_vlm_dir, vlm_data, tmp_path / "run", model={"freeze_vision": freeze},
                                 training={"max_steps": 3}, eval={"before_training": False, "after_training": False}))
    handle = run(cfg, create_backend("cpu"), echo=quiet).model
    original = load_file(str(tiny_vlm_dir / "model.safetensors"))
    params = dict(handle.model.named_parameters())
    tower_lora = {n: p for n, p in params.items() if "vision_tower" in n and "lora_" in n}
    assert bool(tower_lora) is not freeze
    if not freeze:      # trained: B started at zero and moved
        assert any(p.abs().max() > 0 for n, p in tower_lora.items() if "lora_B" in n)
    # The base weights of the tower never change under LoRA.
    base = {n.replace("base_layer.", ""): p for n, p in params.items() if "lora_" not in n}
    tower = [name for name in original if name.startswith(VISION)]
    assert len(tower) > 10
    for name in tower:
        key = next(k for k in base if k.endswith("." + name))
        assert torch.equal(base[key].detach(), original[name]), name


@pytest.mark.parametrize("freeze", [True, False])
def test_full_fine_tuning_trains_the_vision_tower_only_when_asked(tiny_vlm_dir, vlm_data, tmp_path, freeze):
    cfg = vlm_config(tiny_vlm_dir, vlm_data, tmp_path / "run", adapter={"type": "none"},
                     model={"freeze_vision": freeze}, training={"max_steps": 3, "learning_rate": 1e-3})
    res = CliRunner().invoke(main, ["run", "--config", write_cfg(tmp_path, cfg)])
    assert res.exit_code == 0, res.output
    before = load_file(str(tiny_vlm_dir / "model.safetensors"))
    after = load_file(str(tmp_path / "run" / "model.safetensors"))
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    tower = {k for k in before if k.startswith(VISION)}
    assert len(tower) > 10 and changed - tower, "the language model must train"
    assert bool(changed & tower) is not freeze
    losses = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert losses["final_loss"] < losses["first_loss"]


def test_bad_runs_are_refused_before_anything_is_written(tiny_vlm_dir, tiny_model_dir, vlm_data, tmp_path):
    runner = CliRunner()
    missing = write_jsonl(vlm_data["root"] / "missing.jsonl",
                          [image_record("images/red.png", "what color is this?", "red"),
                           image_record("images/purple.png", "what color is this?", "purple")])
    cases = [
        (vlm_config(tiny_vlm_dir, vlm_data, tmp_path / "a", data={"packing": True}),
         "data.packing: packing is not exact for vision-language models"),
        (vlm_config(tiny_vlm_dir, {**vlm_data, "train": missing}, tmp_path / "b"),
         "missing.jsonl:2: messages[0].content[0]: image file not found: images/purple.png"),
        (vlm_config(tiny_model_dir, vlm_data, tmp_path / "c"),
         "train.jsonl:1: messages[0].content[0] is an image part; images are read by vision-language models"),
    ]
    for cfg, message in cases:
        res = runner.invoke(main, ["run", "--config", write_cfg(tmp_path, cfg)])
        assert res.exit_code == 2, res.output
        assert message in res.output and "Traceback" not in res.output
        assert not (tmp_path / cfg["output_dir"]).exists()
    res = runner.invoke(main, ["run", "--config", write_cfg(tmp_path, cases[0][0]), "--set", "data.packing=false",
                               "--backend", "mlx"])
    assert res.exit_code == 2 and "backend: vision-language fine-tuning runs on the torch backends" in res.output


def test_lora_target_names_are_the_language_models_unless_the_tower_trains(tiny_vlm_dir):
    from mudpuppy.config import AdapterConfig, ModelConfig
    from mudpuppy.errors import MudpuppyError

    backend = create_backend("cpu")
    fc1 = AdapterConfig(target_modules=["fc1"])          # a name only CLIP's MLP has
    handle = backend.load_model(ModelConfig(base_model=str(tiny_vlm_dir)), "fp32", adapter=fc1)
    with pytest.raises(MudpuppyError, match=r"fc1 match no linear layer.*the vision tower is frozen"):
        backend.attach_adapter(handle, fc1)
    handle = backend.load_model(ModelConfig(base_model=str(tiny_vlm_dir), freeze_vision=False), "fp32", adapter=fc1)
    info = backend.attach_adapter(handle, fc1)
    trained = [n for n, p in handle.model.named_parameters() if p.requires_grad]
    assert info.target_modules == ["fc1"] and trained and all(".vision_tower." in n and ".fc1." in n for n in trained)
