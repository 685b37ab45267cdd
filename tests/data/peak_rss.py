"""Peak memory of tokenizing SFT data (or preference pairs) into the store, measured in a child process
(tests/data, tests/slow).

The child loads the data, tokenizes it (uncached: the store goes to
.scratch) and reports its own `ru_maxrss` and its workers' largest, so the
figure is this one preparation's, not whatever the test process held before.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

WORDS = ("turn the kitchen light on off set a timer for ten minutes play music louder lock front door "
         "what is weather tomorrow remind me to buy milk bread coffee open garage close window").split()

CHILD = textwrap.dedent("""
    import json, resource, sys
    from transformers import AutoTokenizer
    from mudpuppy.configure import load_config
    from mudpuppy.data import load_data, prepare_data

    cfg, method = load_config(sys.argv[1], check_files=False), sys.argv[3]
    data = prepare_data(cfg, AutoTokenizer.from_pretrained(sys.argv[2]), load_data(cfg, method), method=method)
    mine, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"examples": len(data.train), "tokens": data.train.total_tokens(),
                      "peak_mb": mine.ru_maxrss / 1024, "workers_peak_mb": workers.ru_maxrss / 1024}))
""")


def write_chats(path: Path, count: int, seed: int = 0, answer_words: tuple[int, int] = (10, 40)) -> Path:
    """`count` seeded two-turn chats, written line by line (the file is never held whole)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            ask = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15)))
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*answer_words)))
            f.write(json.dumps({"messages": [{"role": "user", "content": ask},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


def write_pairs(path: Path, count: int, seed: int = 0) -> Path:
    """`count` seeded preference pairs (a chat prompt, two answers of 10-40 words), written line by line."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            ask = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15)))
            chosen, rejected = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40))) for _ in range(2))
            f.write(json.dumps({"prompt": [{"role": "user", "content": ask}], "chosen": chosen,
                                "rejected": rejected}) + "\n")
    return path


def preprocess_peak(work: Path, tokenizer_dir: Path, data: Path, num_proc: int, method: str = "sft") -> dict:
    """{examples, tokens, peak_mb, workers_peak_mb} of one uncached preparation of `data` for `method`, in a
    child."""
    config = work / f"{data.stem}.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"base_model": str(tokenizer_dir)}, "output_dir": str(work / "out"),
        "data": {"datasets": [{"path": str(data)}], "sequence_len": 256, "cache": False, "num_proc": num_proc,
                 "cache_dir": str(work / "cache")}}))
    done = subprocess.run([sys.executable, "-c", CHILD, str(config), str(tokenizer_dir), method],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
