"""Generate the preference, KTO, reward and PRM datasets the method configs train on.

    python configs/data/make_preference.py      # rewrites the files below, beside this script

From the quickstart's smart-home commands (same train/validation split, so
held-out prompts are never trained on):

    smart_home_pref_{train,val}.jsonl    {prompt, chosen, rejected}: chosen is the right intent label,
                                         rejected a wrong one (half the time its near miss, e.g.
                                         lights_on for lights_off): dpo, ipo, simpo, orpo, rm
    smart_home_kto_{train,val}.jsonl     {prompt, completion, label}: the right label (true) or a
                                         wrong one (false), alternating: kto
    smart_home_reward_{train,val}.jsonl  {text, label}: "Command: ...\\nIntent: ..." scored 1 (right)
                                         or -1 (wrong): rm with mean squared error

and from generated arithmetic:

    arithmetic_prm_{train,val}.jsonl     {prompt, completions, labels}: a + b * c worked in three
                                         steps, some with a mistake; a step is right when it and every
                                         step before it are: prm

Deterministic (seeded): running it again writes the same files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from make_smart_home import INTENTS, generate

# Intents a model confuses most easily: the rejected answer is one of these half the time.
NEAR = {"lights_on": "lights_off", "lights_off": "lights_on", "lights_dim": "lights_on",
        "device_on": "device_off", "device_off": "device_on", "door_lock": "door_unlock",
        "door_unlock": "door_lock", "alarm_set": "music_play", "music_play": "alarm_set",
        "thermostat_set": "device_on", "weather_query": "alarm_set", "shopping_add": "music_play"}


def wrong_label(label: str, rng: random.Random) -> str:
    if rng.random() < 0.5:
        return NEAR[label]
    return rng.choice([other for other in sorted(INTENTS) if other != label])


def split_record(record: dict) -> tuple[list[dict], str]:
    """(system + user messages, the right label) of a quickstart chat record."""
    messages = record["messages"]
    return messages[:-1], messages[-1]["content"]


def preference_rows(records: list[dict], rng: random.Random) -> list[dict]:
    rows = []
    for rec in records:
        prompt, label = split_record(rec)
        rows.append({"prompt": prompt, "chosen": label, "rejected": wrong_label(label, rng)})
    return rows


def kto_rows(records: list[dict], rng: random.Random) -> list[dict]:
    rows = []
    for i, rec in enumerate(records):
        prompt, label = split_record(rec)
        good = i % 2 == 0
        rows.append({"prompt": prompt, "completion": label if good else wrong_label(label, rng), "label": good})
    return rows


def reward_rows(records: list[dict], rng: random.Random) -> list[dict]:
    rows = []
    for i, rec in enumerate(records):
        prompt, label = split_record(rec)
        good = i % 2 == 0
        intent = label if good else wrong_label(label, rng)
        rows.append({"text": f"Command: {prompt[-1]['content']}\nIntent: {intent}", "label": 1.0 if good else -1.0})
    return rows


def prm_row(rng: random.Random) -> dict:
    a, b, c = rng.randint(2, 30), rng.randint(2, 12), rng.randint(2, 12)
    product, total = b * c, a + b * c
    mistake = rng.choice([None, None, "product", "sum", "answer"])
    shown_product = product + rng.choice([-2, -1, 1, 2]) if mistake == "product" else product
    shown_total = a + shown_product
    if mistake == "sum":
        shown_total += rng.choice([-3, -1, 1, 3])
    answer = shown_total + (rng.choice([-10, 10]) if mistake == "answer" else 0)
    steps = [f"{b} * {c} = {shown_product}", f"{a} + {shown_product} = {shown_total}", f"The answer is {answer}."]
    right = [shown_product == product, shown_total == total, answer == total]
    # A step after a mistake builds on a wrong value: it is wrong too.
    labels = [all(right[: i + 1]) for i in range(len(steps))]
    return {"prompt": f"What is {a} + {b} * {c}?", "completions": steps, "labels": labels}


def write(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} records to {path}")


def main() -> None:
    here = Path(__file__).parent
    train, val = generate()
    rng = random.Random(11)
    for split, records in (("train", train), ("val", val)):
        write(here / f"smart_home_pref_{split}.jsonl", preference_rows(records, rng))
        write(here / f"smart_home_kto_{split}.jsonl", kto_rows(records, rng))
        write(here / f"smart_home_reward_{split}.jsonl", reward_rows(records, rng))
    write(here / "arithmetic_prm_train.jsonl", [prm_row(rng) for _ in range(240)])
    write(here / "arithmetic_prm_val.jsonl", [prm_row(rng) for _ in range(60)])


if __name__ == "__main__":
    main()
