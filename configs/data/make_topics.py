"""Split the smart-home preference pairs into three topics for configs/curriculum.yaml.

    python configs/data/make_topics.py      # rewrites topic_*_{train,val}.jsonl beside this script

Each pair goes to the topic of its right answer (the `chosen` intent label);
the train/validation split is the quickstart's, so held-out prompts are never
trained on. Deterministic: running it again writes the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOPICS = {
    "comfort": {"lights_on", "lights_off", "lights_dim", "thermostat_set", "device_on", "device_off"},
    "security": {"door_lock", "door_unlock", "alarm_set"},
    "errands": {"shopping_add", "music_play", "weather_query"},
}


def main() -> None:
    for split in ("train", "val"):
        rows = [json.loads(line) for line in (HERE / f"smart_home_pref_{split}.jsonl").read_text().splitlines()]
        for topic, labels in TOPICS.items():
            kept = [r for r in rows if r["chosen"] in labels]
            (HERE / f"topic_{topic}_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
            print(f"topic_{topic}_{split}.jsonl: {len(kept)} pairs")


if __name__ == "__main__":
    main()
