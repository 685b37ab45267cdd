"""Generate the vision-language example dataset: pictures of one coloured shape, labelled "<colour> <shape>".

    python configs/data/make_shapes.py      # rewrites shapes/*.png and shapes_{train,val}.jsonl beside this file

Each record is a chat whose user turn holds an image part (a path relative to
the JSONL file) and a question; the assistant answers with the label. Shapes
vary in size and position; train and validation pictures never repeat each
other; the output is deterministic (seeded). Needs Pillow.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
COLORS = {"red": (210, 40, 40), "green": (40, 170, 70), "blue": (50, 80, 210), "yellow": (235, 200, 40)}
SHAPES = ("circle", "square", "triangle")
QUESTION = "What shape is in this picture, and what colour? Answer as '<colour> <shape>'."
SIZE = 64


def draw(shape: str, color: str, rng: random.Random) -> Image.Image:
    img = Image.new("RGB", (SIZE, SIZE), (245, 245, 240))
    side = rng.randint(24, 44)
    x, y = rng.randint(2, SIZE - side - 2), rng.randint(2, SIZE - side - 2)
    pen = ImageDraw.Draw(img)
    if shape == "circle":
        pen.ellipse((x, y, x + side, y + side), fill=COLORS[color])
    elif shape == "square":
        pen.rectangle((x, y, x + side, y + side), fill=COLORS[color])
    else:
        pen.polygon([(x + side // 2, y), (x, y + side), (x + side, y + side)], fill=COLORS[color])
    return img


def main() -> None:
    rng = random.Random(7)
    folder = HERE / "shapes"
    folder.mkdir(exist_ok=True)
    splits = {"train": [], "val": []}
    for color in COLORS:
        for shape in SHAPES:
            for k in range(3):        # two pictures to train on, one held out, per label
                split = "val" if k == 2 else "train"
                name = f"shapes/{color}_{shape}_{k}.png"
                draw(shape, color, rng).save(HERE / name, optimize=True)
                splits[split].append({"messages": [
                    {"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": QUESTION}]},
                    {"role": "assistant", "content": f"{color} {shape}"}]})
    for split, records in splits.items():
        rng.shuffle(records)
        (HERE / f"shapes_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    main()
