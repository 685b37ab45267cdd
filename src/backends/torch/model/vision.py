"""Vision-language models on torch: what differs from a causal LM, and nothing else.

transformers gives every image-text-to-text model the same outline (LLaVA,
Idefics3/SmolVLM, Qwen2-VL, Gemma 3, ...):

    model               the ...ForConditionalGeneration, loaded with AutoModelForImageTextToText
      .model            the backbone: a vision tower, a projector, and .language_model
      .lm_head          the output head

so the loss runs the backbone (which puts the image features in place of the
image tokens) and then the head on the positions with a target, as for text.
The pixels of a batch come from the processor's own image step, run on the
image files each row names; the ids already hold each image's token run (the
data side, data/vision.py, expanded them exactly as the processor does).
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import torch
from torch import nn

from ....errors import MudpuppyError

# Where the vision encoder sits in transformers' image-text-to-text models.
VISION_TOWER_NAMES = ("vision_tower", "vision_model", "visual", "vision_encoder", "image_encoder")
# What the processor returns for text: the batch brings its own ids and masks.
TEXT_OUTPUTS = {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "text_replacement_offsets"}


def is_vision_checkpoint(model_cfg, path: Path) -> bool:
    """Whether `path` is loaded as a vision-language model: model.vision, or for auto its config.json."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    has_vision = "vision_config" in config
    wanted = getattr(model_cfg, "vision", "auto")
    if wanted is True and not has_vision:
        raise MudpuppyError(f"model.vision is true, but {path} is not a vision-language model (its config.json has "
                            "no vision_config); set model.vision: auto, or point base_model at one")
    return has_vision if wanted == "auto" else bool(wanted)


def language_model_path(model: nn.Module) -> str:
    """The qualified name of the language model inside a vision-language model."""
    decoder = model.get_decoder()
    for name, module in model.named_modules():
        if module is decoder:
            return name
    raise MudpuppyError(f"{type(model).__name__}: cannot find its language model among its modules")


def vision_tower(model: nn.Module) -> tuple[str, nn.Module]:
    """(qualified name, module) of the vision encoder."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in VISION_TOWER_NAMES:
            return name, module
    raise MudpuppyError(f"{type(model).__name__}: cannot find its vision tower (looked for a submodule named "
                        f"{', '.join(VISION_TOWER_NAMES)}); set model.freeze_vision: false to train the whole model")


def freeze_vision_tower(model: nn.Module) -> int:
    """Full fine-tuning with model.freeze_vision: the vision encoder keeps its weights; returns how many."""
    _, tower = vision_tower(model)
    frozen = 0
    for p in tower.parameters():
        p.requires_grad_(False)
        frozen += p.numel()
    return frozen


def lora_targets(model: nn.Module, wanted, freeze_vision: bool, choose) -> tuple[list[str], list[str] | str]:
    """(leaf names adapted, PEFT's target_modules). With the vision tower frozen only the language
    model's linears are adapted: leaf names alone (q_proj, fc1...) would also match the vision
    tower's, so PEFT gets a pattern anchored at the language model's path instead."""
    head = model.get_output_embeddings()
    linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head]
    if not freeze_vision:
        leaves = choose({n.rsplit(".", 1)[-1] for n in linear}, wanted)
        return leaves, leaves
    prefix = language_model_path(model)
    try:
        leaves = choose({n.rsplit(".", 1)[-1] for n in linear if n.startswith(prefix + ".")}, wanted)
    except MudpuppyError as exc:
        raise MudpuppyError(f"{exc} (the language model's; the vision tower is frozen: model.freeze_vision: "
                            "false adapts its layers too)") from None
    return leaves, rf"{re.escape(prefix)}\..*\.(?:{'|'.join(map(re.escape, leaves))})"


def backbone(model: nn.Module) -> nn.Module:
    """What computes the hidden states the output head reads: the multimodal backbone, which runs the
    vision tower and merges its features (get_decoder() would be the language model alone)."""
    return model.model


def pixel_inputs(processor, images: list[tuple[str, ...]], model: nn.Module, device: torch.device,
                 input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The image inputs of a batch: the processor's image step on every row's files, in order, plus the
    per-token modality ids some models (M-RoPE, Gemma 3's image attention) read from the ids."""
    from ....data.images import load_image

    files = [f for row in images for f in row]
    params = inspect.signature(model.forward).parameters
    out: dict[str, torch.Tensor] = {}
    if files:
        pictures = []
        for f in files:
            try:
                pictures.append(load_image(f))
            except OSError as exc:
                raise MudpuppyError(f"image {f} cannot be read ({exc})") from None
        processed = processor(text=[processor.image_token * len(files)], images=pictures, return_tensors="pt")
        dtype = next(backbone(model).parameters()).dtype
        for key, value in processed.items():
            if key in TEXT_OUTPUTS or key not in params or not isinstance(value, torch.Tensor):
                continue
            out[key] = (value.to(dtype) if value.is_floating_point() else value).to(device)
    for key in ("mm_token_type_ids", "token_type_ids"):
        if key in params and hasattr(processor, "create_mm_token_type_ids"):
            try:
                kinds = processor.create_mm_token_type_ids(input_ids.tolist())
            except TypeError:          # a processor whose version needs more than the ids
                break
            out[key] = torch.as_tensor(kinds, dtype=torch.long, device=device)
            break
    return out
