"""The `mudpuppy` command line as a whole: every verb reachable from each entry point, user mistakes
ending in one line and exit code 2, and the before/after table a run ends with. (Each verb's own
behaviour is tested beside what it drives: tests/training, tests/export, tests/serving, ...)"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml
from click.testing import CliRunner

import mudpuppy.cli as cli
from mudpuppy.cli import main
from mudpuppy.cli.tables import before_after_table
from mudpuppy.evaluation import EvalResult

VERBS = ["backends", "chat", "convert-adapter", "eval", "export", "init", "merge", "parity", "preprocess", "run",
         "score", "serve", "train", "ui", "validate"]


def test_every_verb_is_registered_and_importable_from_mudpuppy_cli():
    assert sorted(main.commands) == VERBS
    for name in cli.__all__:
        assert getattr(cli, name) is main or getattr(cli, name) in main.commands.values()


@pytest.mark.parametrize("module", ["mudpuppy", "mudpuppy.cli"])
def test_python_dash_m_runs_the_same_cli(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.split("Commands:")[1].splitlines() if line.strip()]
    assert listed == VERBS


def test_an_unknown_verb_exits_2():
    res = CliRunner().invoke(main, ["nosuch"])
    assert res.exit_code == 2 and "No such command 'nosuch'" in res.output


def test_cli_validate_exit_codes(tiny_config, tmp_path):
    runner = CliRunner()
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(tiny_config))
    ok = runner.invoke(main, ["validate", str(good)])
    assert ok.exit_code == 0 and "ok" in ok.output
    tiny_config["training"]["learning_rate"] = -0.1
    tiny_config["training"]["optimiser"] = "adamw"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(tiny_config))
    res = runner.invoke(main, ["validate", str(bad)])
    assert res.exit_code == 2
    assert "2 problems" in res.output
    assert "training.learning_rate" in res.output and "training.optimiser" in res.output
    assert "Traceback" not in res.output


def test_cli_backends_lists_each_backend_with_a_verdict():
    res = CliRunner().invoke(main, ["backends"])
    assert res.exit_code == 0
    lines = [l for l in res.output.splitlines() if not l.startswith(" ")]
    assert [l.split()[0] for l in lines] == ["rocm", "cuda", "mlx", "cpu"]
    assert all(("available" in l) for l in lines)
    assert any(l.startswith("cpu") and "unavailable" not in l for l in lines)


def test_cli_run_with_unavailable_backend_exits_2(tiny_config, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_config))
    res = CliRunner().invoke(main, ["run", "--config", str(path), "--backend", "rocm"])
    import torch

    if torch.version.hip:
        pytest.skip("ROCm build present")
    assert res.exit_code == 2
    assert "error: rocm:" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "run").exists()


def test_the_table_shows_what_either_evaluation_measured():
    before = EvalResult(loss=2.0, exact_match=0.25, samples=4)
    after = EvalResult(loss=1.5, samples=4)
    lines = before_after_table(SimpleNamespace(before=before, after=after)).splitlines()
    assert lines[0].split() == ["before", "after"]
    assert set(lines[1]) == {"-"} and len(lines[1]) == len(lines[0])
    assert lines[2].split() == ["held-out", "loss", "2.0000", "1.5000"]
    assert lines[3].split() == ["exact", "match", "25.0%", "-"]
    assert len(lines) == 4


def test_the_table_names_grpo_rewards_and_is_empty_without_evaluations():
    before = EvalResult(reward=0.25, rewards={"exact_match": 0.5}, samples=2)
    after = EvalResult(reward=0.5, rewards={"exact_match": 0.75, "length": 0.1}, samples=2)
    lines = before_after_table(SimpleNamespace(before=before, after=after)).splitlines()
    assert [line.split() for line in lines[2:]] == [["reward", "0.250", "0.500"], ["exact_match", "0.500", "0.750"],
                                                    ["length", "-", "0.100"]]
    assert before_after_table(SimpleNamespace(before=None, after=None)) == ""


def test_the_table_names_an_objectives_accuracy():
    before = EvalResult(loss=0.6931, accuracy=0.5, accuracy_name="reward_accuracy", metrics={}, samples=8)
    lines = before_after_table(SimpleNamespace(before=before, after=None)).splitlines()
    assert [line.split() for line in lines[2:]] == [["held-out", "loss", "0.6931", "-"],
                                                    ["reward", "accuracy", "50.0%", "-"]]
