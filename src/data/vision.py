"""Vision-language data: chat records with images, rendered and tokenized the way the model's processor does.

A vision-language model comes with a processor: its tokenizer, its image
processor and its chat template, which writes one placeholder (``<image>``,
``<|image_pad|>``...) per image part. Before tokenizing, the processor replaces
each placeholder by the image's real token run (``<image>`` x 64, or rows of
tiles for SmolVLM), whose length depends on the image's size. This module does
the same, on text, so the rest of the data pipeline is unchanged:

    render      the conversation through the processor's template (`VisionTokenizer`)
                with the usual character spans of the trained turns (render.py)
    expand      each placeholder replaced by the processor's own replacement string
                (`processor.get_text_with_replacements`), the spans moved with it
    tokenize    the expanded text, exactly the ids the processor would produce; the
                image runs are "blocked": their tokens never carry loss, whatever the turn

A replacement is computed once per image size (the processor runs on one image
of that size); the pixels are produced per batch by the backend, from the image
paths each example keeps (`ImageExample`). No torch here: the processor is
called with numpy outputs only.
"""

from __future__ import annotations

import json
from pathlib import Path

from .images import load_image, record_images
from .render import Rendered
from .tools import RecordError

# transformers' chat templates for vision-language models iterate content parts.
TEXT, IMAGE = "text", "image"


class VisionTokenizer:
    """A processor seen by the data pipeline as a tokenizer.

    Everything a tokenizer does (ids, offsets, special tokens, decoding) goes to the
    processor's tokenizer; chat templates render through the processor's template with
    each message's content as parts; saving writes the whole processor, so a run's
    output directory loads with AutoProcessor.
    """

    def __init__(self, processor):
        object.__setattr__(self, "processor", processor)
        object.__setattr__(self, "tokenizer", processor.tokenizer)
        object.__setattr__(self, "replacements", {})      # image size -> the processor's replacement string

    def __getattr__(self, name):
        if name in ("processor", "tokenizer", "replacements"):    # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __setattr__(self, name, value):
        if name == "chat_template":       # data.chat_template installs a template on both
            self.processor.chat_template = value
        setattr(self.tokenizer, name, value)

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.tokenizer)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.processor, "chat_template", None) or getattr(self.tokenizer, "chat_template", None)

    @property
    def image_token(self) -> str:
        return self.processor.image_token

    def apply_chat_template(self, conversation, tools=None, tokenize=False, add_generation_prompt=False, **kwargs):
        messages = [as_parts(m) for m in conversation]
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tools=tools,
                                                  tokenize=tokenize, add_generation_prompt=add_generation_prompt,
                                                  **kwargs)

    def save_pretrained(self, path, **kwargs):
        return self.processor.save_pretrained(path, **kwargs)

    def image_replacement(self, path: str, size) -> str:
        """The text the processor puts in place of one placeholder for an image of this size."""
        key = tuple(size)
        if key not in self.replacements:
            out = self.processor(text=[self.image_token], images=[load_image(path)],
                                 return_text_replacement_offsets=True)
            self.replacements[key] = out["text_replacement_offsets"][0][0]["replacement"]
        return self.replacements[key]


def load_vision_tokenizer(source: str, trust_remote_code: bool = False) -> VisionTokenizer:
    """The processor of a vision-language model directory, as the data pipeline's tokenizer."""
    from transformers import AutoProcessor

    from ..errors import MudpuppyError

    processor = AutoProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
    if getattr(processor, "image_token", None) is None or not hasattr(processor, "get_text_with_replacements"):
        raise MudpuppyError(f"{source}: the processor ({type(processor).__name__}) has no image placeholder token "
                            "or replacement step (transformers 5.24+ processors with an image_token); mudpuppy "
                            "cannot tell which tokens are the image's")
    tok = VisionTokenizer(processor)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def is_vision_tokenizer(tokenizer) -> bool:
    return isinstance(tokenizer, VisionTokenizer)


def as_parts(message: dict) -> dict:
    """A message with its content as the parts a vision-language template iterates."""
    out = {k: v for k, v in message.items() if k != "parts"}
    parts = message.get("parts")
    if parts and "".join(p["text"] for p in parts if p["type"] == TEXT) == message["content"]:
        out["content"] = [{"type": TEXT, "text": p["text"]} if p["type"] == TEXT else {"type": IMAGE} for p in parts]
    else:
        # Plain text, or a probe that replaced the content (render.turn_frame): images first, then the text.
        images = [{"type": IMAGE} for p in parts or () if p["type"] == IMAGE]
        out["content"] = images + [{"type": TEXT, "text": message["content"]}]
    return out


def expand_images(tokenizer: VisionTokenizer, item: Rendered, record: dict) -> Rendered:
    """The rendered conversation with each image placeholder replaced as the processor replaces it,
    its loss spans moved along, and the image runs blocked from loss."""
    parts = [p for m in record.get("messages", ()) for p in m.get("parts", ()) if p["type"] == IMAGE]
    placeholder = tokenizer.image_token
    found = item.text.count(placeholder)
    if found != len(parts):
        raise RecordError(f"the chat template wrote {found} image placeholder(s) {placeholder!r} for the record's "
                          f"{len(parts)} image(s) (a template that drops images, or the placeholder typed in a "
                          "message's text); every image needs exactly one placeholder")
    if not parts:
        return item
    replacements = [tokenizer.image_replacement(p["image"], p["size"]) for p in parts]
    [text], [offsets] = tokenizer.processor.get_text_with_replacements([item.text], images_replacements=replacements)

    def moved(pos: int) -> int:
        return pos + sum(len(o["replacement"]) - (o["span"][1] - o["span"][0]) for o in offsets if o["span"][1] <= pos)

    spans = [(moved(a), moved(b), kind) for a, b, kind in item.spans]
    blocked = [tuple(o["new_span"]) for o in offsets]
    return Rendered(text, spans, item.add_special_tokens, item.append_eos, item.anchors,
                    images=tuple(record_images(record)), blocked=blocked)


# --------------------------------------------------------------------------- which runs are vision runs

def model_config_json(base_model: str, revision: str | None = None) -> dict | None:
    """A model's config.json when it is on this machine (a local directory or the hub cache), without
    downloading anything; None otherwise (a .gguf file or alias is a text model)."""
    path = Path(base_model).expanduser()
    if path.is_dir():
        found = path / "config.json"
    elif "/" in base_model and not path.exists():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(base_model, "config.json", revision=revision)
        except Exception:        # a name the hub would refuse: not a cached model
            cached = None
        found = Path(cached) if isinstance(cached, str) else None
    else:
        found = None
    try:
        return json.loads(found.read_text()) if found is not None and found.is_file() else None
    except (OSError, ValueError):
        return None


def is_vision_model(model_cfg) -> bool:
    """`model.vision`, or for `auto` whether the model's config.json describes a vision tower."""
    vision = getattr(model_cfg, "vision", "auto")
    if vision != "auto":
        return bool(vision)
    config = model_config_json(model_cfg.base_model, getattr(model_cfg, "revision", None))
    return bool(config) and "vision_config" in config


def vision_problems(cfg, vision: bool) -> list[tuple[str, str]]:
    """(config path, problem) for settings a vision-language run cannot honour."""
    from .templates import BUILTIN_TEMPLATES

    if not vision:
        return []
    problems = []
    if cfg.method != "sft":
        problems.append(("method", f"vision-language models train with method: sft; {cfg.method} is text-only here"))
    if cfg.data.packing:
        problems.append(("data.packing", "packing is not exact for vision-language models (the model places image "
                                         "features and positions per row, so packed examples would see each "
                                         "other); set it to false (data.tokens_per_batch keeps padding low)"))
    if cfg.adapter.type == "qlora":
        problems.append(("adapter.type", "qlora is not available for vision-language models; use lora, dora or none"))
    if cfg.data.chat_template in BUILTIN_TEMPLATES:
        problems.append(("data.chat_template", f"the built-in {cfg.data.chat_template!r} template writes text only; "
                                               "a vision-language model renders with its processor's template "
                                               "(leave it unset) or a Jinja template that writes image parts"))
    if cfg.eval.exact_match:
        problems.append(("eval.exact_match", "held-out generation does not pass images to the model yet; "
                                             "vision-language runs measure held-out loss (set it to false)"))
    if cfg.memory.stream_layers:
        problems.append(("memory.stream_layers", "not available for vision-language models"))
    if cfg.backend == "mlx":
        problems.append(("backend", MLX_VISION))
    return problems


MLX_VISION = ("vision-language fine-tuning runs on the torch backends (cpu, cuda, rocm); the mlx backend has no "
              "vision path (mlx-lm loads text models only, and mlx-vlm's LoRA trainer is a separate training loop "
              "mudpuppy does not drive); run it with --backend cpu, cuda or rocm")
