"""A store's folder outlives a killed writer only until the next writer: claims.py.

The writer is killed (SIGKILL, as the OOM killer does) in a child process
between tokenizing and mapping, the moment the issue names; the next run
removes what it left, never reads it as a store, and leaves a live
process's folder alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import yaml

from mudpuppy.data import claims, prepare_sft_data

pytestmark = pytest.mark.skipif(claims.fcntl is None, reason="claims are swept where flock exists")

KILLED = textwrap.dedent("""
    import os, signal, sys
    from transformers import AutoTokenizer
    from mudpuppy.configure import load_config
    from mudpuppy.data import cache, pipeline, prepare_sft_data

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    # Tokenized, not yet mapped (uncached) / not yet renamed into an entry (cached).
    pipeline.TokenStore = die
    cfg = load_config(sys.argv[1], check_files=False)
    prepare_sft_data(cfg, AutoTokenizer.from_pretrained(sys.argv[2]), write_cache=cfg.data.cache)
""")

HOLDS = textwrap.dedent("""
    import sys
    from pathlib import Path
    from mudpuppy.data import claims
    claim = claims.Claim(Path(sys.argv[1]), "store-")
    print(claim.folder, flush=True)
    sys.stdin.read()
""")


def killed_run(tmp_path, tokenizer_dir, data, cache: bool):
    raw = {"model": {"base_model": str(tokenizer_dir)}, "output_dir": str(tmp_path / "out"),
           "data": {"datasets": [{"path": str(data)}], "sequence_len": 128, "cache": cache,
                    "cache_dir": str(tmp_path / "cache")}}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    done = subprocess.run([sys.executable, "-c", KILLED, str(config), str(tokenizer_dir)], capture_output=True)
    assert done.returncode == -9, done.stderr.decode()[-2000:]


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_a_scratch_store_of_a_killed_run_goes_with_the_next_run(make_cfg, tok, tokenizer_dir, write, tmp_path):
    data = write("d.jsonl", [{"text": f"line {i}"} for i in range(10)])
    killed_run(tmp_path, tokenizer_dir, data, cache=False)
    scratch = tmp_path / "cache" / ".scratch"
    left = leftovers(scratch)
    assert len(left) == 2 and any(n.startswith("store-") and n.endswith(".lock") for n in left)
    again = prepare_sft_data(make_cfg([data], cache=False), tok)
    assert again.report.cache == "off" and len(again.train) == 10
    assert leftovers(scratch) == []


def test_a_cache_entry_half_written_by_a_killed_run_is_never_read(make_cfg, tok, tokenizer_dir, write, tmp_path):
    data = write("d.jsonl", [{"text": f"line {i}"} for i in range(10)])
    killed_run(tmp_path, tokenizer_dir, data, cache=True)
    root = tmp_path / "cache"
    staged = [n for n in leftovers(root) if n.startswith(".") and not n.endswith(".lock")]
    assert len(staged) == 1 and (root / staged[0] / "tokens.bin").is_file()
    written = prepare_sft_data(make_cfg([data]), tok, write_cache=True)
    assert written.report.cache == "written"            # tokenized afresh: the staged folder was no entry
    assert leftovers(root) == [os.path.basename(written.report.cache_path)]
    assert prepare_sft_data(make_cfg([data]), tok).report.cache == "reused"


def test_a_live_writers_folder_is_left_alone(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDS, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        folder = holder.stdout.readline().strip()
        assert claims.sweep(tmp_path, r"store-.*") == [] and os.path.isdir(folder)
    finally:
        holder.communicate("")
    # Its writer ended without releasing the claim: the lock went with the process.
    assert [str(p) for p in claims.sweep(tmp_path, r"store-.*")] == [folder] and leftovers(tmp_path) == []


def test_a_folder_without_a_claim_goes_once_a_day_old(tmp_path):
    old, new = tmp_path / "store-old", tmp_path / "store-new"
    for folder in (old, new):
        folder.mkdir()
        (folder / "tokens.bin").write_bytes(b"1234")
    day_ago = time.time() - claims.UNCLAIMED_AGE - 60
    os.utime(old, (day_ago, day_ago))
    assert claims.sweep(tmp_path, r"store-.*") == [old] and leftovers(tmp_path) == ["store-new"]


def test_a_released_claim_leaves_nothing(tmp_path):
    claim = claims.Claim(tmp_path, "store-")
    (claim.folder / "tokens.bin").write_bytes(b"1234")
    claims.release(claim.folder)
    assert leftovers(tmp_path) == []


def test_a_file_system_without_locks_still_writes_and_never_sweeps(tmp_path, monkeypatch):
    def refuse(fd, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(claims.fcntl, "flock", refuse)
    claim = claims.Claim(tmp_path, "store-")
    (claim.folder / "tokens.bin").write_bytes(b"1234")
    assert claims.sweep(tmp_path, r"store-.*") == [] and claim.folder.is_dir()
    claim.release()
    assert leftovers(tmp_path) == []
