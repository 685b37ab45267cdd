"""Fixtures for the MLX backend: both runtimes on one tiny model, and helpers to compare them.

Nothing here imports mlx at module level: the adapter-format tests run
without it, and MLX-needing modules skip themselves with importorskip.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ...conftest import QUICKSTART_DATA, build_tiny_model


@pytest.fixture(scope="session")
def wide_model_dir(tmp_path_factory) -> Path:
    """The shared tiny model, 64 wide, so int4's groups of 64 fit (QLoRA tests)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-64"), hidden_size=64)


@pytest.fixture()
def mlx_config(tiny_config) -> dict:
    cfg = json.loads(json.dumps(tiny_config))
    cfg["backend"] = "mlx"
    return cfg


@pytest.fixture(scope="session")
def mlx_backend():
    pytest.importorskip("mlx.core")
    from mudpuppy import create_backend

    return create_backend("mlx")


@pytest.fixture(scope="session")
def torch_backend():
    from mudpuppy import create_backend

    return create_backend("cpu")


def model_cfg(path: Path):
    from mudpuppy.config import ModelConfig

    return ModelConfig(base_model=str(path))


def random_batch(vocab: int, rows: int = 3, width: int = 12, seed: int = 0):
    """Token ids with ragged right padding, labels on the real tokens."""
    from mudpuppy.data import Batch

    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, (rows, width))
    attn = np.ones_like(ids)
    for r in range(1, rows):
        attn[r, width - 3 * r :] = 0
    ids[attn == 0] = 0
    labels = np.where(attn == 1, np.roll(ids, -1, axis=1), -100)
    labels[:, -1] = -100
    return Batch(ids, labels, attn)


def training_batches(cfg, tokenizer, steps: int, accumulation: int):
    from mudpuppy.data import Batcher, prepare_sft_data

    data = prepare_sft_data(cfg, tokenizer)
    batcher = Batcher(data.train, cfg.training.micro_batch_size, tokenizer.pad_token_id, cfg.training.seed)
    return [[batcher.next_batch() for _ in range(accumulation)] for _ in range(steps)]


def quickstart_rows(n: int) -> list[dict]:
    lines = (QUICKSTART_DATA / "smart_home_val.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[:n]]


def make_peft_adapter(model_dir: Path, out: Path, *, dora: bool = False, rslora: bool = False,
                      targets=("q_proj", "v_proj", "down_proj"), r: int = 4, alpha: float = 6, seed: int = 0):
    """A PEFT adapter on the tiny model whose B (and DoRA magnitude) are random, so it changes outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_dora=dora, use_rslora=rslora,
                        task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
            elif "lora_magnitude_vector" in name:
                p.mul_(torch.rand_like(p) + 0.5)
    model.save_pretrained(str(out))
    return model.eval()
