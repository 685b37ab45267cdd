"""What a finished run leaves for people: plain progress lines off a terminal, charts, and a model card."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys

import pytest
import yaml

from mudpuppy.monitor.progress import PlainProgress, progress_bar
from mudpuppy.monitor.report import model_card, smooth, write_charts


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


class FakeTty(io.StringIO):
    def isatty(self):
        return True


def test_off_a_terminal_progress_is_plain_lines():
    stream = io.StringIO()
    bar = progress_bar(45, 0, True, stream=stream)
    assert isinstance(bar, PlainProgress)
    for step in range(45):
        bar.set_postfix(loss=f"{1 / (step + 1):.4f}", tok_s="100")
        bar.update(1)
    bar.close()
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    # auto: every round(45 / 20) = 2 steps, plus the first and the last
    assert lines[0].startswith("train step 1/45 (2%) loss 1.0000 tok_s 100 elapsed ")
    assert lines[-1].startswith("train step 45/45 (100%) loss 0.0222")
    assert len(lines) == 1 + 22 + 1
    assert all("eta" in line for line in lines)


def test_progress_every_and_resume_offset():
    stream = io.StringIO()
    bar = progress_bar(100, 40, True, every=25, stream=stream)
    for _ in range(60):
        bar.update(1)
    steps = [line.split()[2] for line in stream.getvalue().splitlines()]
    assert steps == ["41/100", "50/100", "75/100", "100/100"]


def test_on_a_terminal_the_bar_is_tqdm():
    bar = progress_bar(10, 0, True, stream=FakeTty())
    assert not isinstance(bar, PlainProgress)
    bar.close()
    assert progress_bar(10, 0, False) is None


def test_smoothing_is_debiased():
    assert smooth([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    s = smooth([10.0] + [0.0] * 50)
    assert s[0] == pytest.approx(10.0) and s[-1] < s[1] < s[0]


def test_charts_for_each_method(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"step": i, "loss": 2.0 / i, "lr": 1e-3, "reward": i / 10, "reward_margin": i / 5,
             "reward_accuracy": 0.5 + i / 40} for i in range(1, 11)]
    rows.append({"step": 5, "eval_loss": 0.7})
    rows.append({"step": 10, "eval_reward": 0.9})
    for method, extra in (("sft", None), ("grpo", "reward.png"), ("preference", "margins.png")):
        out = tmp_path / method
        out.mkdir()
        written = write_charts(out, method, rows)
        assert written == ["loss.png"] + ([extra] if extra else [])
        for name in written:
            w, h = png_size(out / name)
            assert 600 <= w <= 1000 and 300 <= h <= 800
    assert write_charts(tmp_path / "sft", "sft", []) == []


def test_run_writes_loss_png_and_a_model_card_the_hub_parses(tiny_config, tmp_path):
    pytest.importorskip("matplotlib")
    from huggingface_hub import ModelCard

    tiny_config["training"]["eval_steps"] = 3
    tiny_config["logging"] = {"progress_bar": True}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_config))
    # A real process with stderr piped: not a terminal, so plain progress lines.
    res = subprocess.run([sys.executable, "-m", "mudpuppy", "run", "-c", str(path)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "\r" not in res.stderr
    assert "train step 6/6 (100%) loss " in res.stderr
    out = tmp_path / "run"
    w, h = png_size(out / "loss.png")
    assert (w, h) == (800, 650)
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == tiny_config["model"]["base_model"]
    assert card.data.library_name == "peft"
    assert "mudpuppy" in card.data.tags and "lora" in card.data.tags
    text = card.text
    summary = json.loads((out / "run_summary.json").read_text())
    assert "![loss](loss.png)" in text
    assert "| held-out | before | after |" in text
    assert f"| loss | {summary['eval_before']['loss']:.4f}".rstrip("0") in text
    assert f"-m mudpuppy run -c {path}" in text or f"mudpuppy run -c {path}" in text
    assert "[More Information Needed]" not in text          # PEFT's placeholder card is replaced


def test_card_for_an_alias_names_the_upstream_model(tmp_path):
    cfg = {"model": {"base_model": "smollm2-135m-instruct"}, "method": "preference",
           "preference": {"type": "orpo"}, "adapter": {"type": "qlora", "r": 8, "alpha": 16,
                                                       "target_modules": "all-linear", "quant_backend": "int4"},
           "data": {"datasets": [{"path": "trl-lib/ultrafeedback_binarized"}, {"path": "data/x.jsonl"}],
                    "sequence_len": 512},
           "training": {"learning_rate": 1e-4}}
    text = model_card(tmp_path / "orpo-run", cfg, {"steps": 3}, [], plots_missing=True)
    front = yaml.safe_load(text.split("---")[1])
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert front["datasets"] == ["trl-lib/ultrafeedback_binarized"]
    assert front["tags"][:3] == ["mudpuppy", "preference", "orpo"]
    assert "matplotlib was not installed" in text
    assert "base quantized int4" in text
