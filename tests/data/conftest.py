"""Fixtures for the data tests: the tiny chatml tokenizer, files written on the fly, configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mudpuppy.configure import load_config

SAMPLES = Path(__file__).resolve().parents[2] / "configs" / "data"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The tiny model's tokenizer alone: most data tests need no model (and no torch)."""
    from tests.conftest import build_tokenizer

    path = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture()
def tok(tokenizer_dir):
    """A fresh tokenizer per test: prepare may install a chat template on it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture()
def write(tmp_path):
    """write(name, records_or_text) -> path; lists of dicts become JSON lines."""

    def _write(name: str, content) -> Path:
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif isinstance(content, str):
            path.write_text(content, encoding="utf-8")
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in content), encoding="utf-8")
        return path

    return _write


@pytest.fixture()
def make_cfg(tokenizer_dir, tmp_path):
    """make_cfg(datasets, **data_overrides) -> RunConfig whose data cache lives in tmp_path."""

    def _make(datasets, val=None, training=None, **data):
        spec = [d if isinstance(d, dict) else {"path": str(d)} for d in datasets]
        raw = {
            "model": {"base_model": str(tokenizer_dir)},
            "data": {"datasets": spec, "sequence_len": 128, "cache_dir": str(tmp_path / "cache"), **data},
            "training": {"seed": 3, "micro_batch_size": 2, **(training or {})},
            "output_dir": str(tmp_path / "out"),
        }
        if val:
            raw["data"]["val_datasets"] = [v if isinstance(v, dict) else {"path": str(v)} for v in val]
        return load_config(raw, check_files=False)

    return _make
