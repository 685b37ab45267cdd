"""Generate the GRPO prompts configs/grpo.yaml trains on: small sums, each with its answer.

    python configs/data/make_rl.py      # rewrites arithmetic_rl_{train,val}.jsonl beside this script

Each record is an rl-format prompt with an `answer` column, which the
exact_match reward reads:

    {"prompt": "What is 3 + 8? Reply with only the number.", "answer": "11"}

Sums of two numbers from 0 to 20, every pair once; 40 pairs are held out
for the greedy held-out reward. Deterministic (seeded).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
HELD_OUT = 40


def main() -> None:
    pairs = [(a, b) for a in range(21) for b in range(21)]
    random.Random(0).shuffle(pairs)
    records = [{"prompt": f"What is {a} + {b}? Reply with only the number.", "answer": str(a + b)}
               for a, b in pairs]
    write(HERE / "arithmetic_rl_val.jsonl", records[:HELD_OUT])
    write(HERE / "arithmetic_rl_train.jsonl", records[HELD_OUT:])


def write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    print(f"wrote {len(records)} records to {path}")


if __name__ == "__main__":
    main()
