"""A two-step LoRA run of the tiny model, trained with a chat template its tokenizer does not carry
(zephyr over the tokenizer's chatml): chat and serve must render with the run's template."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from ..conftest import tiny_run_config

RUN_TEMPLATE = "zephyr"


@pytest.fixture(scope="session")
def chat_run(tiny_model_dir, tmp_path_factory) -> Path:
    from mudpuppy import create_backend, load_config, run

    cfg = tiny_run_config(tiny_model_dir, tmp_path_factory.mktemp("chat-run") / "run")
    cfg["training"].update(max_steps=2, learning_rate=2e-2)
    cfg["data"].update(chat_template=RUN_TEMPLATE, cache=False, val_datasets=[])
    cfg["data"]["datasets"][0]["num_samples"] = 16
    cfg["eval"] = {"before_training": False, "after_training": False}
    run(load_config(cfg), create_backend("cpu"), echo=lambda *_a, **_k: None)
    return Path(cfg["output_dir"])


@pytest.fixture(scope="session")
def torch_chat(chat_run):
    from mudpuppy.serving import load_chat_model

    return load_chat_model(str(chat_run), "cpu", "fp32")


@pytest.fixture(scope="session")
def nonstop(torch_chat):
    """The tiny model with no stop token: every answer runs to max_tokens."""
    return replace(torch_chat, stop_ids=[])


def conversation() -> list[dict]:
    """Two exchanges under a system prompt; the answers are the quickstart's style."""
    return [
        {"role": "system", "content": "You control the lights."},
        {"role": "user", "content": "Turn on the kitchen light."},
        {"role": "assistant", "content": "Kitchen light is on."},
        {"role": "user", "content": "And dim the hallway to 30%."},
        {"role": "assistant", "content": "Hallway dimmed to 30%."},
    ]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
