"""benchmarks/grpo_cpu.py end to end at its smallest: one run of each side (TRL GRPOTrainer, mudpuppy) on the
real SmolLM2-135M-Instruct, 1 warm-up + 2 timed steps, 8-token completions; the results JSON holds both sides
with positive timings, token counts and memory. About 1-2 minutes on a 2-core CPU (`make test-slow`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ..conftest import REPO

pytestmark = pytest.mark.slow


def test_grpo_benchmark_runs_both_sides(tmp_path):
    out = tmp_path / "grpo_cpu.json"
    res = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "grpo_cpu.py"), "--repeat", "1", "--steps", "2",
         "--max-completion-length", "8", "--threads", "1", "--out", str(out), "--work", str(tmp_path / "work")],
        capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.loads(out.read_text())
    runs = {r["side"]: r for r in results["runs"]}
    assert sorted(runs) == ["mudpuppy", "trl"]
    for side, r in runs.items():
        assert len(r["step_seconds"]) == 3, (side, r["step_seconds"])           # warm-up + 2 timed
        for key in ("step_seconds", "generation_seconds", "rollout_seconds", "completion_tokens", "completions"):
            assert all(v > 0 for v in r[key]), (side, key, r[key])
        assert r["peak_rss_mb"] > 0 and r["threads"] == 1
        assert all(g <= s for g, s in zip(r["generation_seconds"], r["step_seconds"])), side
    assert "mudpuppy/TRL" in res.stdout and "s/1k compl tok" in res.stdout
    table = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "grpo_cpu.py"), "--table-only", "--out", str(out)],
        capture_output=True, text=True, cwd=REPO)
    assert table.returncode == 0 and "mudpuppy/TRL" in table.stdout, table.stderr[-3000:]
