"""Vision-language chat data: image parts rendered and expanded exactly as the processor does, loss on the
assistant's text only, and every bad input refused with its file and line (or config path)."""

from __future__ import annotations

import numpy as np
import pytest

from mudpuppy.configure import load_config
from mudpuppy.data import collate, load_data, prepare_sft_data
from mudpuppy.data.examples import ImageExample
from mudpuppy.data.images import load_image
from mudpuppy.data.vision import load_vision_tokenizer
from mudpuppy.errors import ConfigError, DataError

from .conftest import IMAGE_TOKEN, TOKENS_PER_IMAGE, image_record, vlm_config, write_image, write_jsonl


def prepare(tiny_vlm_dir, files, tmp_path, **sections):
    cfg = load_config(vlm_config(tiny_vlm_dir, files, tmp_path / "out", **sections))
    tok = load_vision_tokenizer(str(tiny_vlm_dir))
    return prepare_sft_data(cfg, tok, load_data(cfg)), tok


def processor_ids(tok, record: dict) -> list[int]:
    """What the model's own processor makes of the record: its template, then processor(text, images)."""
    text = tok.apply_chat_template(record["messages"], tokenize=False)
    images = [load_image(p["image"]) for m in record["messages"] for p in m.get("parts", ()) if p["type"] == "image"]
    return tok.processor(text=[text], images=images, add_special_tokens=False)["input_ids"][0]


def test_ids_are_the_processors_and_only_the_answer_carries_loss(any_vlm_dir, vlm_data, tmp_path):
    prepared, tok = prepare(any_vlm_dir, vlm_data, tmp_path)
    records = load_data(load_config(vlm_config(any_vlm_dir, vlm_data, tmp_path / "o"))).train[0].records
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    assert len(prepared.train) == 4
    counts = set()
    for ex, rec in zip(prepared.train, records):
        assert isinstance(ex, ImageExample)
        # The same ids as the processor gives, each image expanded to its own token run.
        assert ex.input_ids.tolist() == processor_ids(tok, rec.data)
        is_image = ex.input_ids == image_id
        counts.add(int(is_image.sum()))
        # The whole run the processor wrote for the image (tiles, rows, markers) carries no loss,
        # and ends where the question starts.
        first = int(np.flatnonzero(is_image)[0])
        assert not ex.loss_mask[first : ex.image_end].any()
        assert tok.decode(ex.input_ids[ex.image_end :]).startswith("what color is this?")
        # Loss on the answer and the turn's end marker, nothing else.
        answer = rec.data["messages"][1]["content"]
        assert tok.decode(ex.input_ids[ex.loss_mask]) == answer + "<|im_end|>"
        assert ex.images == (str(vlm_data["root"] / "images" / f"{answer}.png"),)
    if any_vlm_dir.name.startswith("tiny-llava"):
        assert counts == {TOKENS_PER_IMAGE}       # CLIP crops every image to the same size
    else:
        assert len(counts) > 1                    # tiles follow the image's shape: expanded per size


def test_image_tokens_never_carry_loss_even_when_prompts_train(tiny_vlm_dir, vlm_data, tmp_path):
    spec = {"path": str(vlm_data["train"]), "train_on_inputs": True}
    prepared, tok = prepare(tiny_vlm_dir, vlm_data, tmp_path, data={"datasets": [spec]})
    ex = prepared.train[0]
    is_image = ex.input_ids == tok.convert_tokens_to_ids(IMAGE_TOKEN)
    assert not (ex.loss_mask & is_image).any()
    assert "what color is this?" in tok.decode(ex.input_ids[ex.loss_mask])


def test_several_images_keep_their_order_and_batches_carry_them(any_vlm_dir, vlm_data, tmp_path):
    record = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "first"}, {"type": "image", "image": "images/blue.png"},
        {"type": "text", "text": "then"}, {"type": "image", "image": "images/red.png"}]},
        {"role": "assistant", "content": "blue then red"}]}
    data = {**vlm_data, "train": write_jsonl(vlm_data["root"] / "two.jsonl", [record])}
    prepared, tok = prepare(any_vlm_dir, data, tmp_path)
    ex = prepared.train[0]
    root = vlm_data["root"] / "images"
    assert ex.images == (str(root / "blue.png"), str(root / "red.png"))
    rec = load_data(load_config(vlm_config(any_vlm_dir, data, tmp_path / "o"))).train[0].records[0].data
    assert ex.input_ids.tolist() == processor_ids(tok, rec)
    assert tok.decode(ex.input_ids[ex.loss_mask]) == "blue then red<|im_end|>"
    batch = collate([ex, prepared.val[0]], tok.pad_token_id)
    assert batch.images == [ex.images, prepared.val[0].images]


@pytest.mark.parametrize("part", [
    {"type": "image", "path": "images/green.png"},
    {"type": "image_url", "image_url": {"url": "images/green.png"}},
    {"type": "input_image", "image_url": "file://{root}/images/green.png"},
])
def test_the_image_part_shapes_exports_write_give_the_same_example(tiny_vlm_dir, vlm_data, tmp_path, part):
    part = {k: v.format(root=vlm_data["root"]) if isinstance(v, str) else v for k, v in part.items()}
    other = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "what color is this?"}]},
                          {"role": "assistant", "content": "green"}]}
    canonical = {**vlm_data, "train": write_jsonl(vlm_data["root"] / "a.jsonl",
                                                  [image_record("images/green.png", "what color is this?", "green")])}
    shaped = {**vlm_data, "train": write_jsonl(vlm_data["root"] / "b.jsonl", [other])}
    a = prepare(tiny_vlm_dir, canonical, tmp_path)[0].train[0]
    b = prepare(tiny_vlm_dir, shaped, tmp_path)[0].train[0]
    assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
    assert a.images == b.images


@pytest.mark.parametrize("image,problem", [
    ("images/missing.png", "messages[0].content[0]: image file not found: images/missing.png"),
    ("images/broken.png", "messages[0].content[0]: image file images/broken.png cannot be read as an image"),
    ("https://example.com/cat.png", "is a web address; images are read from local files only"),
])
def test_a_bad_image_is_named_with_file_and_line(tiny_vlm_dir, vlm_data, tmp_path, image, problem):
    (vlm_data["root"] / "images" / "broken.png").write_bytes(b"not a png at all")
    records = [image_record("images/red.png", "what color?", "red"), image_record(image, "what color?", "red")]
    cfg = load_config(vlm_config(tiny_vlm_dir, {**vlm_data, "train": write_jsonl(vlm_data["train"], records)},
                                 tmp_path / "out"))
    with pytest.raises(DataError) as err:
        load_data(cfg)
    assert err.value.file.endswith("train.jsonl") and err.value.line == 2
    assert problem in err.value.detail


def test_an_image_in_an_assistant_turn_is_refused(tiny_vlm_dir, vlm_data, tmp_path):
    record = {"messages": [{"role": "user", "content": "draw it"},
                           {"role": "assistant", "content": [{"type": "image", "image": "images/red.png"}]}]}
    cfg = load_config(vlm_config(tiny_vlm_dir, {**vlm_data, "train": write_jsonl(vlm_data["train"], [record])},
                                 tmp_path / "out"))
    with pytest.raises(DataError, match=r"train.jsonl:1: messages\[1\].content\[0\] is an image in a 'assistant' turn"):
        load_data(cfg)


def test_an_example_whose_images_do_not_fit_is_dropped_not_cut(tiny_vlm_dir, vlm_data, tmp_path):
    # A cut through an image's 16 tokens would leave tokens without their pixels: such examples are dropped.
    with pytest.raises(DataError, match=r"\(6 too long, 0 with no trained tokens\)"):
        prepare(tiny_vlm_dir, vlm_data, tmp_path, data={"sequence_len": 12})


def test_image_records_for_a_text_only_model_name_file_and_line(tiny_model_dir, vlm_data, tmp_path):
    cfg = load_config(vlm_config(tiny_model_dir, vlm_data, tmp_path / "out"))
    with pytest.raises(DataError) as err:
        load_data(cfg)
    assert err.value.line == 1 and "messages[0].content[0] is an image part" in err.value.detail
    assert "this is a text-only model" in err.value.detail and "model.vision: true" in err.value.detail


@pytest.mark.parametrize("section,key", [
    ({"data": {"packing": True}}, "data.packing: packing is not exact for vision-language models"),
    ({"method": "preference"}, "method: vision-language models train with method: sft"),
    ({"adapter": {"type": "qlora"}}, "adapter.type: qlora is not available for vision-language models"),
    ({"data": {"chat_template": "chatml"}}, "data.chat_template: the built-in 'chatml' template writes text only"),
    ({"eval": {"exact_match": True}}, "eval.exact_match: held-out generation does not pass images"),
    ({"backend": "mlx"}, "backend: vision-language fine-tuning runs on the torch backends"),
])
def test_settings_a_vision_run_cannot_honour_are_config_errors(tiny_vlm_dir, vlm_data, tmp_path, section, key):
    with pytest.raises(ConfigError) as err:
        load_config(vlm_config(tiny_vlm_dir, vlm_data, tmp_path / "out", **section))
    assert any(p.startswith(key) for p in err.value.problems), err.value.problems


def test_model_vision_true_is_checked_without_reading_the_model(vlm_data, tmp_path):
    raw = vlm_config("org/some-vlm", vlm_data, tmp_path / "out", model={"vision": True}, data={"packing": True})
    with pytest.raises(ConfigError, match="data.packing"):
        load_config(raw, check_files=False)


def test_a_hub_vision_model_found_only_after_loading_is_checked_when_its_data_is_prepared(
        tiny_vlm_dir, vlm_data, tmp_path):
    # A hub model's kind is unknown until it is downloaded: prepare_data checks once the processor is there.
    cfg = load_config(vlm_config(tiny_vlm_dir, vlm_data, tmp_path / "out", data={"packing": True}),
                      check_files=False)
    with pytest.raises(ConfigError, match="data.packing"):
        prepare_sft_data(cfg, load_vision_tokenizer(str(tiny_vlm_dir)))


def test_mlx_refuses_a_vision_model_before_loading_it(tiny_vlm_dir):
    pytest.importorskip("mlx.core")
    from mudpuppy import create_backend
    from mudpuppy.config import ModelConfig
    from mudpuppy.errors import MudpuppyError

    with pytest.raises(MudpuppyError, match="vision-language model: vision-language fine-tuning runs on the torch"):
        create_backend("mlx").load_model(ModelConfig(base_model=str(tiny_vlm_dir)))


def test_the_shipped_example_validates_and_finds_every_image():
    from pathlib import Path

    from mudpuppy.data.images import record_images
    from tests.conftest import REPO

    cfg = load_config(REPO / "configs" / "sft-vlm.yaml")
    loaded = load_data(cfg)
    images = [f for ds in loaded.train + loaded.val for rec in ds.records for f in record_images(rec.data)]
    assert len(images) == 36 and all(Path(f).is_file() and "configs/data/shapes/" in f for f in images)


def test_preprocess_tokenizes_a_vision_config_with_its_processor(tiny_vlm_dir, vlm_data, tmp_path):
    import yaml
    from click.testing import CliRunner

    from mudpuppy.cli import main
    from mudpuppy.data import load_tokenizer
    from mudpuppy.data.vision import is_vision_tokenizer

    raw = vlm_config(tiny_vlm_dir, vlm_data, tmp_path / "out")
    assert is_vision_tokenizer(load_tokenizer(load_config(raw).model, tiny_vlm_dir))
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(main, ["preprocess", str(path), "-n", "0"])
    assert result.exit_code == 0, result.output
    assert f"tokenizer: {tiny_vlm_dir}" in result.output and "image data is tokenized afresh" in result.output
