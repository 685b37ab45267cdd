"""One token store per machine under `--nproc 2` (torch gloo on the CPU, tiny model): local rank 0 tokenizes
or reads the cache, the other rank waits and maps the same files (data/shared.py).

The oracle is the one-process run at the same global batch, as in test_torch_distributed.py: sharing the
store must not change a single batch. Which ranks tokenized is measured (every rank counts the stores it
built and the counts are gathered), and rank 0 prints it.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import yaml


from ..faults import kill_after
from .test_torch_distributed import TOL, _tiny, launch, losses, one_process, sft_config

ONE_RANK = "token store: tokenized by rank 0; mapped by 2 ranks"
REUSED = "token store: tokenized by no rank (the cache entry was reused); mapped by 2 ranks"


def config(tiny_model_dir, tmp_path, name: str, micro: int) -> dict:
    cfg = sft_config(_tiny(tiny_model_dir, tmp_path), tmp_path / name, micro=micro, save_steps=3)
    cfg["data"] = dict(cfg["data"], cache_dir=str(tmp_path / "cache"), num_proc=2)
    return cfg


def test_one_rank_tokenizes_both_map_and_a_resume_trains_the_same_batches(tiny_model_dir, tmp_path):
    reference = config(tiny_model_dir, tmp_path, "one", micro=4)
    one_process(reference)

    # Uncached: rank 0 tokenizes into <cache_dir>/.scratch, both ranks map it, then its names go.
    cfg = config(tiny_model_dir, tmp_path, "two", micro=2)
    done = launch(cfg, tmp_path / "two.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(ONE_RANK) == 1, done.stdout
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), atol=TOL, rtol=0)
    assert list((tmp_path / "cache" / ".scratch").iterdir()) == []

    # Cached by preprocess: rank 0 verifies the entry, neither rank tokenizes; a rank killed at step 3 and
    # the run resumed trains the rest of the uninterrupted run's batches.
    cfg = config(tiny_model_dir, tmp_path, "resumed", micro=2)
    (tmp_path / "resumed.yaml").write_text(yaml.safe_dump(cfg))
    pre = subprocess.run([sys.executable, "-m", "mudpuppy", "preprocess", str(tmp_path / "resumed.yaml"), "-n", "0"],
                         capture_output=True, text=True, timeout=300)
    assert pre.returncode == 0, pre.stderr[-3000:]
    killed = launch(cfg, tmp_path / "resumed.yaml", env=kill_after(3, rank=1))
    assert killed.returncode != 0 and killed.stdout.count(REUSED) == 1, killed.stdout
    resumed = launch(cfg, tmp_path / "resumed.yaml", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count(REUSED) == 1, resumed.stdout
    np.testing.assert_allclose(losses(tmp_path / "resumed"), losses(tmp_path / "one"), atol=TOL, rtol=0)
    entries = [p.name for p in (tmp_path / "cache").iterdir() if p.name != ".scratch"]
    assert len(entries) == 1, entries                                   # one entry, no staging folder left


def test_a_data_error_on_the_tokenizing_rank_stops_both_with_its_message(tiny_model_dir, tmp_path):
    """Rank 1 waits in the collective that carries rank 0's answer: an error there reaches it, not a hang."""
    cfg = config(tiny_model_dir, tmp_path, "short", micro=2)
    # Every example dropped as too long: found while tokenizing, on rank 0 alone.
    cfg["data"] = dict(cfg["data"], sequence_len=9, truncation="drop")
    cfg["data"].pop("val_datasets")
    done = launch(cfg, tmp_path / "short.yaml")
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "no usable training examples after length filtering" in errors[0], done.stderr
