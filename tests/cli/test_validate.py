"""`mudpuppy validate` as a newcomer uses it (issue 39): every shipped config passes, curricula included and
checked stage by stage; `--data` reads the data files through the real reader and names each bad record by
file:line with a non-zero exit; the mix it would train on is printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from mudpuppy.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def validate(*args):
    return CliRunner().invoke(main, ["validate", *[str(a) for a in args]])


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_config_validates(name):
    res = validate(CONFIGS / name)
    assert res.exit_code == 0, res.output
    assert "ok (method" in res.output


def test_a_curriculum_is_checked_stage_by_stage():
    res = validate(CONFIGS / "grpo-tools.yaml", "--data")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "a curriculum of 2 stage(s)" in lines[0]
    assert any(line.startswith("  stage 1 (format): ok (method sft") for line in lines)
    assert any(line.startswith("  stage 2 (reward): ok (method grpo") for line in lines)
    assert "multiply_rl_train.jsonl: rl, 300 usable record(s)" in res.output


def test_a_bad_stage_is_named_by_its_index(tmp_path):
    cur = yaml.safe_load((CONFIGS / "curriculum.yaml").read_text())
    for stage in cur["stages"]:                 # the shipped data, from a copy of the curriculum elsewhere
        for key in ("datasets", "val_datasets"):
            for spec in stage.get("data", {}).get(key, []):
                spec["path"] = str(CONFIGS / spec["path"])
    path = tmp_path / "cur.yaml"
    path.write_text(yaml.safe_dump(cur))
    assert validate(path).exit_code == 0
    cur["stages"][1]["training"] = {"learning_rate": -1}
    path.write_text(yaml.safe_dump(cur))
    res = validate(path)
    assert res.exit_code == 2 and "stages.1.training.learning_rate" in res.output
    assert "1 problem" in res.output and "Traceback" not in res.output


def write_data(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def chat(i: int) -> str:
    return json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]})


def config_with(tiny_config, tmp_path, datasets, **data):
    tiny_config["data"] = dict(tiny_config["data"], datasets=datasets, **data)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_config))
    return path


def test_data_with_a_malformed_line_is_refused_by_file_and_line(tiny_config, tmp_path):
    data = write_data(tmp_path / "train.jsonl", [chat(1), chat(2), '{"messages": [', chat(4), '{"text": 5}', chat(6)])
    cfg = config_with(tiny_config, tmp_path, [{"path": str(data)}])
    assert validate(cfg).exit_code == 0                   # without --data the files are only found
    res = validate(cfg, "--data")
    assert res.exit_code == 2, res.output
    assert "train.jsonl:3:" in res.output and "train.jsonl:5:" in res.output
    assert "2 bad record(s)" in res.output and "skip_bad_records" in res.output
    assert "Traceback" not in res.output


def test_bad_records_a_run_would_skip_are_listed_but_pass(tiny_config, tmp_path):
    data = write_data(tmp_path / "train.jsonl", [chat(1), "not json", chat(3)])
    cfg = config_with(tiny_config, tmp_path, [{"path": str(data)}], skip_bad_records=True)
    res = validate(cfg, "--data")
    assert res.exit_code == 0, res.output
    assert "train.jsonl:2:" in res.output and "2 usable record(s), 1 bad" in res.output


def test_the_mix_is_printed_as_the_run_would_draw_it(tiny_config, tmp_path):
    a = write_data(tmp_path / "a.jsonl", [chat(i) for i in range(30)])
    b = write_data(tmp_path / "b.jsonl", [chat(i) for i in range(10)])
    cfg = config_with(tiny_config, tmp_path, [{"path": str(a), "ratio": 0.75}, {"path": str(b), "ratio": 0.25}])
    plain = validate(cfg)
    assert plain.exit_code == 0 and f"mix: {a} ratio 0.75, {b} ratio 0.25" in plain.output
    read = validate(cfg, "--data")
    assert read.exit_code == 0, read.output
    assert f"{a}: ratio 0.75: 30 of its 30 record(s) (75.0%)" in read.output
    assert f"{b}: ratio 0.25: 10 of its 10 record(s) (25.0%)" in read.output
    weighted = config_with(tiny_config, tmp_path, [{"path": str(a), "weight": 0.5}, {"path": str(b), "weight": 2}])
    res = validate(weighted, "--data")
    assert f"{a}: weight 0.5: 15 of its 30" in res.output and f"{b}: weight 2: 20 of its 10" in res.output


def test_docs_cli_shows_what_validate_prints(monkeypatch):
    """docs/cli.md's capture of `mudpuppy validate configs/grpo-tools.yaml --data` is today's output."""
    doc = (CONFIGS.parent / "docs" / "cli.md").read_text(encoding="utf-8")
    shown = doc.split("$ mudpuppy validate configs/grpo-tools.yaml --data\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(CONFIGS.parent)
    res = validate("configs/grpo-tools.yaml", "--data")
    assert res.exit_code == 0 and res.output == shown
