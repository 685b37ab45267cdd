"""Preparing ten times the chats takes no more memory: the store is written and read by map, the file
streamed, the workers' chunks bounded (the 300k-chat version is in tests/slow/test_data_at_size.py)."""

from __future__ import annotations

from .peak_rss import preprocess_peak, write_chats, write_pairs

GROWTH_MB = 20     # the whole list path held several KB per chat: 10k more chats would be ~50 MB


def test_ten_times_the_chats_in_the_same_memory(tokenizer_dir, tmp_path):
    small = preprocess_peak(tmp_path, tokenizer_dir, write_chats(tmp_path / "small.jsonl", 2_000), 2)
    large = preprocess_peak(tmp_path, tokenizer_dir, write_chats(tmp_path / "large.jsonl", 12_000, seed=1), 2)
    assert (small["examples"], large["examples"]) == (2_000, 12_000)
    assert large["peak_mb"] - small["peak_mb"] < GROWTH_MB, (small, large)
    assert large["workers_peak_mb"] - small["workers_peak_mb"] < GROWTH_MB, (small, large)


def test_ten_times_the_pairs_in_the_same_memory(tokenizer_dir, tmp_path):
    """Preference pairs (dpo) go to the store too: 1.5k and 15k pairs prepared within GROWTH_MB."""
    small = preprocess_peak(tmp_path, tokenizer_dir, write_pairs(tmp_path / "small.jsonl", 1_500), 2, "dpo")
    large = preprocess_peak(tmp_path, tokenizer_dir, write_pairs(tmp_path / "large.jsonl", 15_000, seed=1), 2, "dpo")
    assert (small["examples"], large["examples"]) == (1_500, 15_000)
    assert large["peak_mb"] - small["peak_mb"] < GROWTH_MB, (small, large)
    assert large["workers_peak_mb"] - small["workers_peak_mb"] < GROWTH_MB, (small, large)
