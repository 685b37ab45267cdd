"""Shared fixtures: a tiny random Llama model and a locally trained tokenizer. No network."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

REPO = Path(__file__).resolve().parents[1]
QUICKSTART_DATA = REPO / "configs" / "data"

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus() -> list[str]:
    lines = []
    for name in ("smart_home_train.jsonl", "smart_home_val.jsonl"):
        for line in (QUICKSTART_DATA / name).read_text().splitlines():
            for m in json.loads(line)["messages"]:
                lines.append(m["content"])
    lines += ["hello world", "the quick brown fox jumps over the lazy dog", "0123456789"]
    return lines


def build_tokenizer(path: Path):
    """A byte-level BPE (any text encodes) with chatml special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    return fast


def build_tiny_model(path: Path, seed: int = 0, hidden_size: int = 32) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, initializer_range=0.2,  # wide enough that logits can move
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture()
def tiny_config(tiny_model_dir, tmp_path):
    """A config dict for a short LoRA SFT run of the tiny model on the quickstart data."""
    return tiny_run_config(tiny_model_dir, tmp_path / "run")


def tiny_run_config(model_dir: Path, output_dir: Path) -> dict:
    """The tiny_config dict, for fixtures of a wider scope than one test."""
    return {
        "model": {"base_model": str(model_dir)},
        "backend": "cpu",
        "method": "sft",
        "adapter": {"type": "lora", "r": 4, "alpha": 8, "target_modules": "all-linear"},
        "data": {
            "datasets": [{"path": str(QUICKSTART_DATA / "smart_home_train.jsonl"), "num_samples": 64}],
            "val_datasets": [{"path": str(QUICKSTART_DATA / "smart_home_val.jsonl"), "num_samples": 16}],
            "sequence_len": 128,
        },
        "training": {"max_steps": 6, "micro_batch_size": 4, "learning_rate": 5e-3, "precision": "fp32",
                     "warmup_steps": 1, "seed": 3},
        "eval": {"exact_match": True, "max_new_tokens": 4, "batch_size": 8},
        "output_dir": str(output_dir),
        "logging": {"progress_bar": False},
    }


def random_examples(lengths, vocab: int = 300, seed: int = 0):
    """Token arrays of the given lengths (ids 3..vocab, past the special tokens), the first third of each
    without loss, as a chat prompt: for the tests that compare packed, padded and per-family forwards."""
    import numpy as np

    from mudpuppy.data import Example

    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        mask = np.ones(n, dtype=bool)
        mask[: n // 3] = False
        out.append(Example(rng.integers(3, vocab, n).astype(np.int32), mask))
    return out


def randomize_lora(model, seed: int = 1, scale: float = 0.2, part: str = "lora_B") -> None:
    """LoRA B starts at zero; a random B makes an adapter change the logits, so a test can see it.
    part="lora_" randomizes A too (every gradient non-zero)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if part in name:
                p.copy_(torch.randn(p.shape, generator=generator) * scale)
