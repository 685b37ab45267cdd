"""`mudpuppy parity` on the tiny random Llama: cpu and mlx agree, an injected difference is caught and named,
bad input ends in one message, and the result lands in a run's model card."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from mudpuppy.cli import main
from mudpuppy.training.parity import TOLERANCES, ParityResult, StepRow
from mudpuppy.training.parity_card import HEADING, write_card_section

from ..conftest import QUICKSTART_DATA


def write_config(raw: dict, tmp_path, **training) -> str:
    raw["training"].update(precision="fp32", **training)
    raw["eval"] = {"before_training": False, "after_training": False}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return str(path)


def invoke(*args):
    return CliRunner().invoke(main, ["parity", *args])


def step_rows(output: str) -> list[list[str]]:
    return [line.split() for line in output.splitlines() if line.strip()[:1].isdigit()]


@pytest.mark.mlx
def test_cpu_and_mlx_agree_and_the_card_gets_the_section(tiny_config, tmp_path):
    pytest.importorskip("mlx.core")
    config = write_config(tiny_config, tmp_path)
    run_dir = tmp_path / "finished"
    run_dir.mkdir()
    (run_dir / "README.md").write_text("---\nbase_model: x\n---\n\n# finished\n\n## Use\n\nload it\n", encoding="utf-8")
    res = invoke(config, "--backends", "cpu,mlx", "--steps", "3", "--json", str(tmp_path / "parity.json"),
                 "--card", str(run_dir))
    assert res.exit_code == 0, res.output
    rows = step_rows(res.output)
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert "agree within tolerances over 3 steps" in res.output
    data = json.loads((tmp_path / "parity.json").read_text())
    assert data["ok"] and data["tolerance_class"] == "fp32" and len(data["rows"]) == 3
    assert all(r["loss_diff"] <= TOLERANCES["fp32"].loss * max(1, r["loss"][0]) for r in data["rows"])
    assert data["compared"] == "adapter" and data["tensors"] > 0 and data["max_update"] > 0
    # Nothing was written where the config's run would go.
    assert not (tmp_path / "run").exists()
    card = (run_dir / "README.md").read_text()
    assert card.startswith("---\nbase_model: x\n---") and "## Use\n\nload it" in card
    assert HEADING in card and "| 3 |" in card and "**within tolerances**" in card


@pytest.mark.mlx
def test_the_first_side_runs_the_run(tiny_config, tmp_path):
    """The independent oracle: the losses parity reports for cpu are the ones `mudpuppy run` logs for the
    same config, step for step (same weights, batches, schedule)."""
    pytest.importorskip("mlx.core")
    config = write_config(tiny_config, tmp_path)
    res = invoke(config, "--backends", "cpu,mlx", "--steps", "3", "--json", str(tmp_path / "parity.json"))
    assert res.exit_code == 0, res.output
    ran = CliRunner().invoke(main, ["run", config, "--backend", "cpu"])
    assert ran.exit_code == 0, ran.output
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in logged if "loss" in row][:3]
    parity_losses = [r["loss"][0] for r in json.loads((tmp_path / "parity.json").read_text())["rows"]]
    assert parity_losses == pytest.approx(losses, abs=2e-6)


@pytest.mark.mlx
def test_an_injected_difference_exits_1_naming_the_step(tiny_config, tmp_path, monkeypatch):
    """mlx's updates doubled: step 1 has learning rate 0 (warmup) and step 2's loss comes before any update
    differs, so the first figure beyond tolerance is step 3's loss."""
    pytest.importorskip("mlx.core")
    from mudpuppy.backends.mlx.trainer import MlxTrainer

    original = MlxTrainer.step

    def doubled(self, micro_batches, lr, objective=None):
        return original(self, micro_batches, lr * 2.0, objective)

    monkeypatch.setattr(MlxTrainer, "step", doubled)
    config = write_config(tiny_config, tmp_path)
    res = invoke(config, "--backends", "cpu,mlx", "--steps", "3")
    assert res.exit_code == 1, res.output
    beyond = [line for line in res.output.splitlines() if line.startswith("parity: beyond tolerance")]
    assert beyond and "step 3: loss differs" in beyond[0]
    assert not any("step 1" in line or "step 2" in line for line in beyond)
    assert any("final adapter" in line for line in beyond)


@pytest.mark.mlx
def test_dpo_agrees(tiny_config, tmp_path):
    pytest.importorskip("mlx.core")
    tiny_config.update(method="preference", preference={"type": "dpo", "beta": 0.1})
    tiny_config["data"] = {"datasets": [{"path": str(QUICKSTART_DATA / "smart_home_pref_train.jsonl"),
                                         "num_samples": 32}], "sequence_len": 128}
    config = write_config(tiny_config, tmp_path, micro_batch_size=2, gradient_accumulation_steps=2)
    res = invoke(config, "--backends", "cpu,mlx", "--steps", "3")
    assert res.exit_code == 0, res.output
    assert [r[0] for r in step_rows(res.output)] == ["1", "2", "3"]


@pytest.mark.mlx
@pytest.mark.parametrize("adapter", [{"type": "dora", "r": 4, "alpha": 8, "target_modules": ["q_proj", "down_proj"]},
                                     {"type": "lora", "r": 4, "alpha": 8, "init": "pissa",
                                      "target_modules": ["q_proj", "down_proj"]},
                                     {"type": "lora", "r": 4, "alpha": 8, "init": "olora",
                                      "target_modules": ["q_proj", "down_proj"]},
                                     {"type": "none"}], ids=["dora", "pissa", "olora", "full"])
def test_dora_and_full_fine_tuning_agree(tiny_config, tmp_path, adapter):
    pytest.importorskip("mlx.core")
    tiny_config["adapter"] = adapter
    res = invoke(write_config(tiny_config, tmp_path, learning_rate=1e-3), "--backends", "mlx,cpu", "--steps", "2",
                 "--json", str(tmp_path / "parity.json"))
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "parity.json").read_text())
    assert data["backends"] == ["mlx", "cpu"] and len(data["rows"]) == 2
    assert data["compared"] == ("weights" if adapter["type"] == "none" else "adapter")


@pytest.mark.mlx
def test_what_one_backend_cannot_run_is_refused_by_name(tiny_config, tmp_path):
    pytest.importorskip("mlx.core")
    tiny_config["adapter"] = {"type": "none"}
    config = write_config(tiny_config, tmp_path)
    res = invoke(config, "--backends", "cpu,mlx", "--set", "training.precision=bf16")
    assert res.exit_code == 2, res.output
    assert "error: mlx cannot run this config: training.precision bf16 with adapter.type none" in res.output


@pytest.mark.parametrize("args, says", [
    (["--backends", "cpu,nosuch"], "unknown backend 'nosuch'"),
    (["--backends", "cpu"], "name two different backends"),
    (["--backends", "cpu,cpu"], "name two different backends"),
    (["--backends", "cpu,mlx", "--steps", "0"], "--steps 0"),
    (["--backends", "cpu,mlx", "--set", "adapter.dropout=0.1"], "adapter.dropout 0.1"),
    (["--backends", "cpu,mlx", "--set", "adapter.type=qlora"], "adapter.type qlora"),
], ids=["unknown", "one", "same-twice", "zero-steps", "dropout", "qlora"])
def test_bad_input_exits_2_with_one_message(tiny_config, tmp_path, args, says):
    config = write_config(tiny_config, tmp_path)
    res = invoke(config, *args)
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: ") and says in res.output
    assert res.output.strip().count("\n") == 0, res.output


def test_an_unavailable_backend_gets_the_factorys_message(tiny_config, tmp_path):
    from mudpuppy.backends.factory import probe

    missing = next((n for n in ("cuda", "rocm") if not probe(n).available), None)
    if missing is None:
        pytest.skip("both GPU backends are available here")
    res = invoke(write_config(tiny_config, tmp_path), "--backends", f"cpu,{missing}")
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"error: {missing}: ") and "available here:" in res.output


def test_a_card_without_readme_is_refused_before_training(tiny_config, tmp_path):
    res = invoke(write_config(tiny_config, tmp_path), "--backends", "cpu,mlx", "--card", str(tmp_path))
    assert res.exit_code == 2 and "no model card (README.md)" in res.output


def test_the_card_section_is_replaced_not_repeated(tmp_path):
    result = ParityResult(("cpu", "mlx"), ("cpu", "cpu"), "sft", "lora", "fp32", "fp32", TOLERANCES["fp32"], 1, 10,
                          rows=[StepRow(1, 0.0, (2.0, 2.0), (1.0, 1.0), (10, 10), (5, 5), (False, False))],
                          compared="adapter", tensors=4)
    (tmp_path / "README.md").write_text("# run\n\n## Use\n\nload it\n", encoding="utf-8")
    write_card_section(tmp_path, result, "cfg.yaml")
    result.rows[0] = StepRow(1, 0.0, (2.0, 3.0), (1.0, 1.0), (10, 10), (5, 5), (False, False))
    result.failures = ["step 1: loss differs by 1"]
    write_card_section(tmp_path, result, "cfg.yaml")
    card = (tmp_path / "README.md").read_text()
    assert card.count(HEADING) == 1 and "**beyond tolerances**" in card and "- step 1: loss differs by 1" in card
    assert card.startswith("# run\n\n## Use\n\nload it\n\n")


@pytest.mark.parametrize("config", ["rloo.yaml", "online-dpo.yaml", "grpo.yaml"])
def test_online_methods_are_refused_before_anything_loads(config):
    """RLOO, online DPO and GRPO sample from each runtime's own random stream: parity says so by name."""
    from mudpuppy.configure import load_config
    from mudpuppy.errors import MudpuppyError
    from mudpuppy.training.parity import check_supported

    cfg = load_config(Path(__file__).parents[2] / "configs" / config, check_files=False)
    with pytest.raises(MudpuppyError, match=f"method {cfg.method}: .*own random stream"):
        check_supported(cfg)
