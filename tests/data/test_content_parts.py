"""Message content given as a list of parts: text parts joined as chat templates join them, images refused."""

from __future__ import annotations

import numpy as np
import pytest

from mudpuppy.data import load_data, prepare_sft_data
from mudpuppy.errors import DataError

AS_STRINGS = [
    {"messages": [{"role": "system", "content": "Answer with the intent label."},
                  {"role": "user", "content": "please turn off the kitchen lights"},
                  {"role": "assistant", "content": "lights_off"}]},
    {"messages": [{"role": "user", "content": "lock the door"}, {"role": "assistant", "content": "door_lock"},
                  {"role": "user", "content": "and the garage"}, {"role": "assistant", "content": "garage_lock"}]},
]


def as_parts(text: str, split_at: int | None = None) -> list[dict]:
    """The text as content parts, cut in two where asked (joined back with nothing between)."""
    if split_at is None:
        return [{"type": "text", "text": text}]
    return [{"type": "text", "text": text[:split_at]}, {"type": "text", "text": text[split_at:]}]


def with_parts(record: dict) -> dict:
    return {"messages": [{**m, "content": as_parts(m["content"], len(m["content"]) // 2 if i % 2 else None)}
                         for i, m in enumerate(record["messages"])]}


def test_content_parts_give_the_same_tokens_and_masks_as_strings(write, make_cfg, tok):
    plain = write("plain.jsonl", AS_STRINGS)
    parts = write("parts.jsonl", [with_parts(r) for r in AS_STRINGS])
    a = prepare_sft_data(make_cfg([plain], cache=False), tok).train
    b = prepare_sft_data(make_cfg([parts], cache=False), tok).train
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.loss_mask, y.loss_mask)
        assert x.loss_mask.any()


def test_text_parts_are_joined_with_nothing_between(write, make_cfg):
    record = {"messages": [{"role": "user", "content": [{"type": "text", "text": "turn "},
                                                        {"type": "text", "text": "on"}]},
                           {"role": "assistant", "content": [{"type": "output_text", "text": "lights_on"}]}]}
    loaded = load_data(make_cfg([write("p.jsonl", [record])]))
    assert loaded.train[0].records[0].data["messages"] == [{"role": "user", "content": "turn on"},
                                                          {"role": "assistant", "content": "lights_on"}]


@pytest.mark.parametrize("part", [
    {"type": "image", "image": "photos/kitchen.jpg"},
    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
])
def test_an_image_part_names_the_file_and_line(write, make_cfg, part):
    record = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what room is this?"}, part]},
                           {"role": "assistant", "content": "kitchen"}]}
    path = write("vision.jsonl", [AS_STRINGS[0], record])
    with pytest.raises(DataError) as err:
        load_data(make_cfg([path]))
    assert err.value.line == 2
    assert "messages[0].content[1] is an image part" in err.value.detail and "vision-language" in err.value.detail


@pytest.mark.parametrize("content,expected", [
    ([{"type": "audio", "audio": "a.wav"}], "has type 'audio'; only text parts"),
    (["just a string"], r"content\[0\] must be a content part"),
    ([{"type": "text", "text": 3}], r"content\[0\].text must be a string, found int 3"),
])
def test_other_parts_are_refused_with_what_was_found(write, make_cfg, content, expected):
    record = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]}
    with pytest.raises(DataError, match=expected):
        load_data(make_cfg([write("x.jsonl", [record])]))
