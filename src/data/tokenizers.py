"""The tokenizer every backend loads and every run or export writes.

Loaded one way for all runtimes (EOS pads where the tokenizer names no pad token), so their
batches are identical. Written so that it loads elsewhere: transformers 5 names a plain fast
tokenizer's class `TokenizersBackend`, which transformers 4.x (still pinned by many serving
stacks) cannot load; `PreTrainedTokenizerFast` loads the same files on 4.57 and 5.x with
identical ids, so that is the name written.
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_CONFIG = "tokenizer_config.json"
PORTABLE_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def load_text_tokenizer(model_cfg, model_dir: Path | str):
    """The Hugging Face tokenizer of `model.tokenizer` or `model_dir`, padding with EOS where it names no pad
    token: the one setup every backend uses, so their batches are identical."""
    from transformers import AutoTokenizer

    source = model_cfg.tokenizer or str(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=model_cfg.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def save_tokenizer(tokenizer, path: str | Path) -> None:
    """`tokenizer.save_pretrained(path)` (a processor too), its class written under the name both
    transformers 4.x and 5.x load."""
    tokenizer.save_pretrained(str(path))
    portable_tokenizer_config(Path(path))


def portable_tokenizer_config(directory: Path) -> None:
    config_path = directory / TOKENIZER_CONFIG
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text(encoding="utf-8"))
    name = config.get("tokenizer_class")
    if name in PORTABLE_CLASSES:
        config["tokenizer_class"] = PORTABLE_CLASSES[name]
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
