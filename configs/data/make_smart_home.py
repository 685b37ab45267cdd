"""Generate the quickstart dataset: spoken smart-home commands labelled with their intent.

    python configs/data/make_smart_home.py      # rewrites smart_home_{train,val}.jsonl beside this file

A 135M chat model does not know these snake_case labels, so it starts near 0%
exact match and must learn the mapping from the data. Train and validation
utterances never repeat each other; the output is deterministic (seeded).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SYSTEM = "Classify the smart-home command. Answer with its intent label only."

ROOMS = ["kitchen", "living room", "bedroom", "bathroom", "office", "hallway", "garage", "dining room", "kids' room", "basement"]
DEVICES = ["tv", "fan", "coffee maker", "dishwasher", "washing machine", "heater", "air purifier", "radio"]
TIMES = ["6 am", "6:30", "seven", "7:15 tomorrow", "8 o'clock", "noon", "half past five", "9 pm", "ten thirty", "quarter to eight"]
SONGS = ["some jazz", "my workout playlist", "the news", "lo-fi beats", "classical music", "the latest podcast", "something relaxing", "Taylor Swift"]
TEMPS = ["18", "19", "20", "21", "22", "23", "68", "70", "72", "seventy"]
POLITE = ["", "please ", "hey, ", "could you ", "can you ", "would you ", "ok house, ", "quick, "]
TAIL = ["", " please", " now", " for me", " thanks", " right away"]

INTENTS: dict[str, list[str]] = {
    "lights_on": ["turn on the {room} lights", "switch the lights on in the {room}", "lights on in the {room}",
                  "I need some light in the {room}", "make the {room} bright"],
    "lights_off": ["turn off the {room} lights", "switch off the lights in the {room}", "kill the lights in the {room}",
                   "lights off in the {room}", "it's too bright in the {room}, shut the lights"],
    "lights_dim": ["dim the {room} lights", "lower the lights in the {room}", "make the {room} lights softer",
                   "bring the {room} lights down a bit", "set the {room} lights to half"],
    "thermostat_set": ["set the temperature to {temp} degrees", "make it {temp} degrees in the {room}",
                       "change the thermostat to {temp}", "I want the house at {temp} degrees", "heat the {room} to {temp}"],
    "device_on": ["turn on the {device}", "start the {device}", "switch the {device} on", "power up the {device} in the {room}",
                  "get the {device} going"],
    "device_off": ["turn off the {device}", "stop the {device}", "switch the {device} off", "power down the {device} in the {room}",
                   "shut the {device} down"],
    "alarm_set": ["wake me up at {time}", "set an alarm for {time}", "I need an alarm at {time}", "alarm at {time}",
                  "get me up at {time}"],
    "music_play": ["play {song}", "put on {song}", "start playing {song} in the {room}", "I want to hear {song}",
                   "queue up {song}"],
    "door_lock": ["lock the front door", "lock the {room} door", "make sure the back door is locked", "lock up the house",
                  "secure the {room} door"],
    "door_unlock": ["unlock the front door", "unlock the {room} door", "let the guests in, open the front lock",
                    "open the back door lock", "unlock the garage door"],
    "weather_query": ["what's the weather like today", "will it rain at {time}", "do I need an umbrella",
                      "how cold is it outside", "what's the forecast for tomorrow"],
    "shopping_add": ["add milk to the shopping list", "put {item} on my shopping list", "we're out of {item}, add it to the list",
                     "remember to buy {item}", "add {item} to groceries"],
}
ITEMS = ["eggs", "bread", "coffee", "bananas", "dish soap", "rice", "cheese", "batteries", "paper towels", "olive oil"]


def fill(template: str, rng: random.Random) -> str:
    text = template.format(room=rng.choice(ROOMS), device=rng.choice(DEVICES), time=rng.choice(TIMES),
                           song=rng.choice(SONGS), temp=rng.choice(TEMPS), item=rng.choice(ITEMS))
    return (rng.choice(POLITE) + text + rng.choice(TAIL)).strip()


def record(utterance: str, label: str) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": utterance},
                         {"role": "assistant", "content": label}]}


def generate(n_train: int = 480, n_val: int = 120, seed: int = 7) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    labels = sorted(INTENTS)
    while len(rows) < n_train + n_val:
        label = labels[len(rows) % len(labels)]          # balanced classes
        utterance = fill(rng.choice(INTENTS[label]), rng)
        if utterance.lower() in seen:
            continue
        seen.add(utterance.lower())
        rows.append(record(utterance, label))
    rng.shuffle(rows)
    return rows[:n_train], rows[n_train:]


def write_splits(splits: dict[str, list[dict]]) -> None:
    """Each split as JSON lines next to this script (the other make_*.py scripts use it too)."""
    here = Path(__file__).parent
    for name, rows in splits.items():
        with (here / name).open("w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
        print(f"wrote {len(rows)} records to {here / name}")


def main() -> None:
    train, val = generate()
    write_splits({"smart_home_train.jsonl": train, "smart_home_val.jsonl": val})


if __name__ == "__main__":
    main()
