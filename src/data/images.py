"""Image content parts: which shapes are accepted, where their files are, and reading them.

Exports write an image part in several shapes; all of them name a local file:

    {"type": "image", "image": "photos/kitchen.png"}               transformers' chat templates
    {"type": "image", "path": "photos/kitchen.png"}                 some dataset exporters
    {"type": "image_url", "image_url": {"url": "photos/k.png"}}     OpenAI chat format
    {"type": "input_image", "image_url": "file:///data/k.png"}      OpenAI responses format

A relative path is resolved against the directory of the data file that names it,
so a dataset folder moves as a whole. Remote URLs and inline data URIs are refused
rather than fetched: training must not depend on the network, and a data URI in
JSONL is better written out once as a file. Pillow is imported here only, and only
when a record holds an image (the `vision` extra).
"""

from __future__ import annotations

from pathlib import Path

IMAGE_KEYS = ("image", "path", "image_url", "url")


def image_reference(part: dict, at: str) -> str:
    """The file an image part names, as written in the record."""
    value = next((part[k] for k in IMAGE_KEYS if part.get(k) is not None), None)
    if isinstance(value, dict):                       # {"image_url": {"url": ...}}
        value = value.get("url", value.get("path"))
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{at} is an image part without a file path; write it as "
                         "{'type': 'image', 'image': 'relative/or/absolute/path.png'}")
    if value.startswith(("http://", "https://")):
        raise ValueError(f"{at}: {value!r} is a web address; images are read from local files only "
                         "(download them and name the files)")
    if value.startswith("data:"):
        raise ValueError(f"{at} is an inline data URI; write the image to a file and name the file")
    return value.removeprefix("file://")


def resolve_image(reference: str, base_dir: Path | None, at: str) -> tuple[str, tuple[int, int]]:
    """(absolute path, (width, height)) of a readable image file; ValueError naming `at` otherwise.

    Only the header is read here: the pixels are decoded when a batch needs them."""
    path = Path(reference).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        raise ValueError(f"{at}: image file not found: {reference} (looked at {path})")
    try:
        with open_pil(path) as img:
            size = (int(img.width), int(img.height))
    except OSError as exc:
        raise ValueError(f"{at}: image file {reference} cannot be read as an image ({exc})") from None
    return str(path.resolve()), size


def open_pil(path):
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("image data needs Pillow: pip install 'mudpuppy[vision]' (or pip install pillow)") from None
    return Image.open(path)


def load_image(path: str):
    """The image's pixels as an RGB PIL image (what every image processor accepts)."""
    with open_pil(path) as img:
        return img.convert("RGB")


def record_images(record: dict) -> list[str]:
    """The resolved image paths of a normalized chat record, in the order the conversation shows them."""
    return [p["image"] for m in record.get("messages", ()) for p in m.get("parts", ()) if p["type"] == "image"]


def resolve_images(source, records: list, base_dir: Path | None, tolerant: bool) -> list:
    """Each image part's file found (beside the data file) and checked readable, in place: its
    "image" becomes the absolute path and "size" (width, height) is added. A missing or unreadable
    file is a DataError at the record's line, or with `tolerant` a skipped record."""
    from .readers import Problem, record_error

    out = []
    for rec in records:
        try:
            for i, msg in enumerate(rec.data["messages"]):
                for j, part in enumerate(msg.get("parts", ())):
                    if part["type"] == "image":
                        part["image"], part["size"] = resolve_image(part["image"], base_dir,
                                                                    f"messages[{i}].content[{j}]")
        except ValueError as exc:
            if not tolerant:
                raise record_error(source.name, rec, str(exc)) from None
            source.problems.append(Problem(rec.line, str(exc) if rec.line is not None else f"row {rec.row}: {exc}"))
            continue
        out.append(rec)
    return out
