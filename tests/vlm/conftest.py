"""Tiny random vision-language models with their processors, built locally, and chat records with small
PNG images written beside them. No network.

Two architectures, chosen because their image processors have Pillow implementations (transformers 5's
fast image processors need torchvision, which has no CPU build here) and because they expand an image
differently: LLaVA (a CLIP vision tower, a projector, a 2-layer Llama; every image is 16 <image> tokens)
and Idefics3 / SmolVLM (a SigLIP-style tower, a pixel-shuffle connector; an image is cut into tiles, rows
separated by newlines, so its tokens depend on its size).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH = 32, 8
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2          # CLIP's CLS token is dropped ("default" strategy)
# The processor's template: chatml with content parts, an image part written as the placeholder.
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
COLORS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}


def build_tiny_vlm(path: Path, seed: int = 0, kind: str = "llava") -> Path:
    import torch
    from transformers import AutoModelForImageTextToText, LlamaConfig

    from tests.conftest import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    processor, config = (tiny_llava if kind == "llava" else tiny_idefics3)(tok)
    config.text_config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    return path


def tiny_llava(tok):
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    images = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=PATCH, chat_template=TEMPLATE,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH)
    config = LlavaConfig(vision_config=vision, image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_select_strategy="default", vision_feature_layer=-1)
    return processor, config


def tiny_idefics3(tok):
    from transformers import Idefics3Config, Idefics3Processor, Idefics3VisionConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tiles = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    tok.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", IMAGE_TOKEN,
                                                          "<end_of_utterance>", "<global-img>", *tiles]})
    # Images up to 64 pixels a side, cut into 32-pixel tiles plus a global view; 4 tokens per tile.
    images = Idefics3ImageProcessorPil(size={"longest_edge": 2 * IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE})
    processor = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4, chat_template=TEMPLATE)
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=IMAGE_SIZE, patch_size=PATCH)
    config = Idefics3Config(vision_config=vision.to_dict(), scale_factor=2,
                            image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN))
    return processor, config


def write_image(path: Path, color: str, size=(32, 32)) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.zeros((size[1], size[0], 3), dtype=np.uint8) + np.asarray(COLORS[color], dtype=np.uint8)
    pixels[size[1] // 4 : size[1] // 2, size[0] // 4 : size[0] // 2] = 255      # a white square, to see
    Image.fromarray(pixels).save(path)
    return path


def image_record(image: str, question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                      {"type": "text", "text": question}]},
                         {"role": "assistant", "content": answer}]}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="session")
def tiny_idefics3_dir(tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-idefics3"), kind="idefics3")


@pytest.fixture(params=["llava", "idefics3"])
def any_vlm_dir(request) -> Path:
    """Each tiny architecture in turn."""
    return request.getfixturevalue("tiny_vlm_dir" if request.param == "llava" else "tiny_idefics3_dir")


@pytest.fixture()
def vlm_data(tmp_path) -> dict[str, Path]:
    """train.jsonl (4 records) and val.jsonl (2) in data/, their images in data/images/ (relative paths);
    the images have different sizes and shapes: LLaVA crops them all to 32x32, Idefics3 cuts the wide
    one into fewer tiles than the square ones."""
    root = tmp_path / "data"
    sizes = {"red": (32, 32), "green": (48, 40), "blue": (60, 20), "yellow": (32, 32)}
    for color, size in sizes.items():
        write_image(root / "images" / f"{color}.png", color, size)
    train = [image_record(f"images/{c}.png", "what color is this?", c) for c in COLORS]
    val = [image_record(f"images/{c}.png", "what color is this?", c) for c in ("red", "blue")]
    return {"train": write_jsonl(root / "train.jsonl", train), "val": write_jsonl(root / "val.jsonl", val),
            "root": root}


def vlm_config(model_dir: Path, files: dict[str, Path], output_dir: Path, **sections) -> dict:
    cfg = {
        "model": {"base_model": str(model_dir)},
        "backend": "cpu",
        "method": "sft",
        "adapter": {"type": "lora", "r": 4, "alpha": 8},
        "data": {"datasets": [{"path": str(files["train"])}], "val_datasets": [{"path": str(files["val"])}],
                 "sequence_len": 128, "shuffle": False},
        "training": {"max_steps": 8, "micro_batch_size": 4, "learning_rate": 1e-2, "precision": "fp32",
                     "seed": 3, "lr_scheduler": "constant"},
        "output_dir": str(output_dir),
        "logging": {"progress_bar": False},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg
