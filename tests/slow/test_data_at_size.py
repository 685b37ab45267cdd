"""Hundreds of megabytes of chats prepared in the memory ten thousand take (issue 38's target: within
150 MB), each process measured: the one that reads and writes the store, and its tokenizing workers."""

from __future__ import annotations

import pytest

from ..data.peak_rss import preprocess_peak, write_chats

pytestmark = pytest.mark.slow

TARGET_MB = 150
LARGE = 450_000      # ~220 MB of JSON lines


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tests.conftest import build_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


def test_a_large_jsonl_file_is_prepared_in_bounded_memory(tokenizer_dir, tmp_path):
    small = preprocess_peak(tmp_path, tokenizer_dir, write_chats(tmp_path / "small.jsonl", 10_000), 2)
    data = write_chats(tmp_path / "large.jsonl", LARGE, seed=1, answer_words=(10, 120))
    assert data.stat().st_size > 200e6
    large = preprocess_peak(tmp_path, tokenizer_dir, data, 2)
    assert (small["examples"], large["examples"]) == (10_000, LARGE)
    assert large["peak_mb"] - small["peak_mb"] < TARGET_MB, (small, large)
    assert large["workers_peak_mb"] - small["workers_peak_mb"] < TARGET_MB, (small, large)
