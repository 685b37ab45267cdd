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


FIVE_GB = 5e9


def test_a_five_gigabyte_jsonl_file_is_prepared_in_bounded_memory(tokenizer_dir, tmp_path):
    """Issue 38's 5 GB target: the file is streamed, the store written in chunks, every process flat.
    Long answers (150-500 words, ~1.9 KB a chat) so the file is 5.1 GB with 2.7M chats."""
    small = preprocess_peak(tmp_path, tokenizer_dir, write_chats(tmp_path / "small.jsonl", 10_000,
                                                                 answer_words=(150, 500)), 2)
    count = 2_700_000
    data = write_chats(tmp_path / "five.jsonl", count, seed=2, answer_words=(150, 500))
    assert data.stat().st_size > FIVE_GB, data.stat().st_size
    large = preprocess_peak(tmp_path, tokenizer_dir, data, 2)
    print(f"5 GB JSONL: 10k chats {small}, {count} chats {large}")        # shown with pytest -s
    assert (small["examples"], large["examples"]) == (10_000, count)
    assert large["peak_mb"] - small["peak_mb"] < TARGET_MB, (small, large)
    assert large["workers_peak_mb"] - small["workers_peak_mb"] < TARGET_MB, (small, large)
