"""The --tui dashboard: its picture from a recorded metrics stream, a real run under tmux, and the
plain lines it falls back to off a terminal or when drawing fails."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from rich.console import Console

from mudpuppy.backends.hardware import read_hardware
from mudpuppy.backends.telemetry import Reading
from mudpuppy.monitor import dashboard
from mudpuppy.monitor.dashboard import DashboardState, format_value, render, sparkline
from mudpuppy.monitor.live import LineSink, watch_run

from ..conftest import QUICKSTART_DATA

MUDPUPPY = str(Path(sys.executable).with_name("mudpuppy"))
GIB = 2**30


def recorded_stream() -> list[dict]:
    """Seven training lines of a DPO run as metrics.jsonl holds them, and one held-out line at step 6."""
    rows = []
    for step in range(1, 8):
        rows.append({"step": step, "loss": round(0.7 - 0.05 * step, 6), "lr": 1e-4 * step, "tokens": 512,
                     "tokens_per_second": 150.0 + step, "grad_norm": 2.0 / step, "skipped": False, "epoch": 0,
                     "reward_chosen": 0.1 * step, "reward_rejected": -0.1 * step, "reward_margin": 0.2 * step,
                     "reward_accuracy": 0.5 + 0.05 * step, "elapsed": 2.0 * step})
        if step == 6:
            rows.append({"step": 6, "eval_loss": 0.612345, "eval_reward_accuracy": 0.75, "elapsed": 12.5})
    rows[-1]["loss"] = 1.234567
    return rows


def rendered(state: DashboardState, width: int = 120, height: int = 40) -> str:
    console = Console(record=True, width=width, height=height, file=io.StringIO())
    console.print(render(state, width, height))
    return console.export_text()


def replayed(rows: list[dict], total: int = 20) -> DashboardState:
    state = DashboardState(header={"model": "tiny-llama", "method": "preference (dpo)", "adapter": "lora",
                                   "backend": "cpu on cpu", "output": "out/dpo"})
    state.begin(total, 0, 0.0)
    for row in rows:
        state.observe(row)
    return state


def line_with(text: str, label: str) -> str:
    return next(line for line in text.splitlines() if re.search(rf"│\s+{re.escape(label)}\s", line))


def test_a_recorded_stream_renders_every_panel_with_the_right_numbers():
    state = replayed(recorded_stream())
    state.hardware = [Reading("GPU 0 memory", used=3 * GIB, total=8 * GIB, source="device"),
                      Reading("GPU 0 busy", percent=37, source="NVML"), Reading("process RSS", used=GIB // 2)]
    state.add_log("data: 64 train / 16 held-out examples")
    state.add_log("warning: something to look at", warning=True)
    text = rendered(state)
    for title in ("mudpuppy", "metrics", "hardware", "log"):
        assert f"─ {title} " in text
    assert "latest samples" not in text                                  # no samples: no panel
    assert "method preference (dpo)" in text and "backend cpu on cpu" in text
    assert "step 7/20 (35%)" in text
    # 2 s a step (elapsed 14 s after 7 steps), 13 steps left
    assert "elapsed 14s" in text and "eta 26s" in text and "2.00 s/step" in text
    assert "1.2346" in line_with(text, "loss")
    assert "0.6123" in line_with(text, "held-out loss")
    assert "7.00e-04" in line_with(text, "learning rate")
    assert "1.4000" in line_with(text, "reward_margin") and "0.8500" in line_with(text, "reward_accuracy")
    assert "0.7500" in line_with(text, "eval_reward_accuracy")
    assert "512" in line_with(text, "tokens/step")
    order = [text.index(f"│  {name} ") for name in ("loss", "held-out loss", "learning rate", "grad norm",
                                                        "tokens/s", "reward_margin", "reward_chosen")]
    assert order == sorted(order)                                     # the main metrics first
    assert "3.00/8.00 GiB" in text and "37%" in text and "0.50 GiB" in text
    assert "data: 64 train / 16 held-out examples" in text and "warning: something to look at" in text
    assert not re.search(r"│  (epoch|elapsed|step|skipped)\s", text)  # bookkeeping is no metric row
    assert len(text.splitlines()) <= 39


def test_grpo_metrics_and_samples_and_a_narrow_short_terminal():
    rows = [{"step": s, "loss": 0.01 * s, "lr": 1e-5, "tokens_per_second": 90.5, "grad_norm": 0.5, "epoch": 0,
             "reward": 0.25 * s, "reward_std": 0.1, "rewards/exact_match/mean": 0.25 * s,
             "completions/mean_length": 12.0 + s, "clip_ratio/region_mean": 0.0, "elapsed": float(s)}
            for s in (1, 2, 3)]
    state = replayed(rows, total=10)
    state.samples = [{"prompt": [{"role": "user", "content": "what is\n2 + 2?"}], "completion": "4\n", "reward": 1.0},
                     {"prompt": "name a colour", "completion": "blue, or\nred", "reward": -0.5}]
    text = rendered(state, width=80, height=40)
    assert "latest samples" in text
    assert "+1.000 what is 2 + 2? → 4" in text and "-0.500 name a colour → blue, or red" in text
    assert "0.7500" in line_with(text, "reward") and "0.7500" in line_with(text, "rewards/exact_match/mean")
    assert "15.00" in line_with(text, "completions/mean_length") and "90.50" in line_with(text, "tokens/s")
    assert text.index("│  reward ") < text.index("│  rewards/exact_match/mean")
    assert "step 3/10 (30%)" in text and "eta 7s" in text
    short = rendered(state, width=80, height=24)
    assert len(short.splitlines()) <= 23 and "more in metrics.jsonl" in short
    assert "│  loss " in short                                          # what is cut is the tail, not the loss


def test_values_and_sparklines():
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7], 8) == "▁▂▃▄▅▆▇█"
    assert sparkline([5.0, 5.0], 8) == "▄▄"
    assert sparkline([1.0, float("nan"), 3.0], 8) == "▁ █"
    assert sparkline(list(range(100)), 10) == "▁▂▃▃▄▅▆▆▇█"           # the last `width` values only
    assert format_value("loss", 0.123456) == "0.1235" and format_value("lr", 0.0002) == "2.00e-04"
    assert format_value("tokens", 1234) == "1,234" and format_value("tokens_per_second", 2345.6) == "2,346"
    assert format_value("kl", 0.00001234) == "1.23e-05" and format_value("loss", float("nan")) == "nan"


def test_hardware_readings_for_each_backend_kind():
    cpu = read_hardware(SimpleNamespace(name="cpu", device="cpu"))
    rss = next(r for r in cpu if "RSS" in r.name)
    assert 10 * 2**20 < rss.used < rss.total
    pytest.importorskip("mlx.core")
    mlx = read_hardware(SimpleNamespace(name="mlx", device="cpu"))
    assert [r.name for r in mlx[:3]] == ["MLX active", "MLX peak", "MLX cache"]
    assert all(r.used is not None and r.used >= 0 for r in mlx[:3])


def test_rocm_smi_json_is_matched_to_the_device_by_pci_bus():
    from mudpuppy.backends.torch.devices.telemetry import pick_card_busy

    cards = {"card0": {"GPU use (%)": "12", "PCI Bus": "0000:03:00.0"},
             "card1": {"GPU use (%)": "87", "PCI Bus": "0000:0C:00.0"}, "system": {"Driver version": "6.1"}}
    assert pick_card_busy(cards, "0000:0c:00") == 87.0
    assert pick_card_busy(cards, None) is None                      # two cards, no bus: no guessing
    assert pick_card_busy({"card0": cards["card0"]}, None) == 12.0


def test_while_live_prints_warnings_and_library_bars_go_to_the_log_panel():
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=100, height=30)
    stdout = sys.stdout
    with watch_run(True, console=console, refresh_per_second=50) as echo:
        echo("backend: cpu on cpu")
        print("printed by a library")
        sys.stderr.write("loading 10%\rloading 100%\n")
        warnings.warn("careful with that", UserWarning)
        time.sleep(0.1)
    assert sys.stdout is stdout and sys.stdout is not None
    frame = screen.getvalue().split("mudpuppy")[-1]                   # the last frame drawn
    assert "backend: cpu on cpu" in frame and "printed by a library" in frame
    assert "loading 100%" in frame and "loading 10%" not in frame
    assert "warning: UserWarning: careful with that" in frame
    sink = []
    stream = LineSink(lambda line, warning=None: sink.append(line))
    stream.write("a\nb")
    stream.write("\rc\n")
    assert sink == ["a", "c"]


def test_train_tui_flag_writes_logging_tui_into_the_config(tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from mudpuppy.cli import main

    made = tmp_path / "made.yaml"
    data = str(QUICKSTART_DATA / "smart_home_train.jsonl")
    res = CliRunner().invoke(main, ["train", str(tiny_model_dir), data, "--tui", "--write-config", str(made)])
    assert res.exit_code == 0, res.output
    assert yaml.safe_load(made.read_text())["logging"]["tui"] is True


# -- real runs


def write_config(tiny_config, tmp_path, steps: int, **logging) -> Path:
    tiny_config["training"].update(max_steps=steps, eval_steps=10)
    tiny_config["eval"] = {"exact_match": False, "batch_size": 8}
    tiny_config["logging"] = {"progress_bar": True, **logging}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_config))
    return path


def whole_frame(pane: str) -> bool:
    """A mid-run frame with everything the run has to show: the loss row, the eta, the backend in the
    header, and in the log both the data line (echoed before training began) and the adapter line."""
    return bool(re.search(r"│\s+loss\s+\d+\.\d{4}\s", pane) and re.search(r"eta (?:\d+h)?(?:\d+m)?\d+s", pane)
                and "backend cpu on cpu" in pane and "─ log " in pane and "adapter: " in pane
                and "data: 64 train / 16 held-out examples" in pane)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_a_run_under_tmux_shows_step_loss_and_eta_and_exits_cleanly(tiny_config, tmp_path):
    cfg = write_config(tiny_config, tmp_path, steps=40)
    rc_file, socket = tmp_path / "rc", f"mudpuppy-test-{uuid.uuid4().hex[:8]}"
    # The size given to rich outright: a detached pane starts at tmux's default 80x24 and is resized after
    # the program may have read it, and at 24 lines the log panel holds only its last 3 lines once the
    # held-out row joins the metrics (CI caught frames whose log had scrolled past the data line).
    command = f"COLUMNS=160 LINES=50 {MUDPUPPY} run --tui --config {cfg}; echo $? > {rc_file}; sleep 60"
    tmux = ["tmux", "-L", socket]          # a server of our own: it starts with this test's environment
    subprocess.run([*tmux, "new-session", "-d", "-s", "tui", "-x", "160", "-y", "50", command], check=True)
    try:
        # The run's 40 steps take ~15 s on an idle 2-core machine and minutes on a loaded one (CI beside a
        # benchmark): the deadline is for a hung run, not a slow one.
        mid_run, deadline = None, time.time() + 600
        while not rc_file.exists() and time.time() < deadline:
            pane = subprocess.run([*tmux, "capture-pane", "-p", "-t", "tui"], capture_output=True, text=True).stdout
            step = re.search(r"step (\d+)/40 ", pane)
            # A pane captured while the frame is being redrawn is torn (the terminal gets the frame in chunks;
            # seen on a loaded machine: the header box alone, or the log panel without its first line), so a
            # mid-run frame counts once one capture holds all of it; a run that never draws it fails below.
            if mid_run is None and step and 0 < int(step.group(1)) < 40 and whole_frame(pane):
                mid_run = pane
            time.sleep(0.1 if mid_run is None else 0.5)     # the frame is caught: only the exit code is awaited
        assert mid_run is not None, f"no whole mid-run frame captured; last pane:\n{pane}"
        time.sleep(0.3)
        final = subprocess.run([*tmux, "capture-pane", "-p", "-t", "tui"], capture_output=True, text=True).stdout
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    assert rc_file.read_text().strip() == "0", final
    assert "step 40/40 (100%)" in final and "finished" in final
    assert "held-out loss" in final and "saved to" in final                  # the table goes below the frame
    out = tmp_path / "run"
    assert (out / "run_summary.json").exists() and (out / "adapter_model.safetensors").exists()


def test_off_a_terminal_tui_warns_once_and_prints_plain_lines(tiny_config, tmp_path):
    cfg = write_config(tiny_config, tmp_path, steps=6)
    res = subprocess.run([MUDPUPPY, "run", "--tui", "-c", str(cfg)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("warning: --tui: stdout is not a terminal; showing plain progress lines") == 1
    assert "train step 1/6" in res.stderr and "train step 6/6 (100%) loss " in res.stderr
    assert "\r" not in res.stderr and "\x1b[" not in res.stdout + res.stderr     # no bar, no cursor moves
    assert "saved to" in res.stdout and (tmp_path / "run" / "run_summary.json").exists()


def test_a_grpo_run_shows_its_rewards_and_latest_samples(tiny_config, tmp_path):
    from mudpuppy import create_backend, load_config, run

    cfg = dict(tiny_config, method="grpo", output_dir=str(tmp_path / "grpo"))
    cfg["data"] = {"datasets": [{"path": str(QUICKSTART_DATA / "sample_rl.jsonl")}], "sequence_len": 64}
    cfg["training"] = dict(tiny_config["training"], max_steps=2, micro_batch_size=8, warmup_steps=0)
    cfg["eval"] = {"before_training": False, "after_training": False}
    cfg["grpo"] = {"num_generations": 4, "max_completion_length": 6, "reward_funcs": ["exact_match"]}
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, color_system=None, width=120, height=40)
    with watch_run(True, console=console, refresh_per_second=50) as echo:
        run(load_config(cfg), create_backend("cpu"), echo=echo)
    frame = screen.getvalue().split("─ mudpuppy ")[-1]
    assert "method grpo" in frame and "step 2/2 (100%)" in frame and "finished" in frame
    assert re.search(r"│  reward +-?[\d.]+ ", frame) and "│  rewards/exact_match/mean " in frame
    samples = re.findall(r"│ [+-]\d\.\d{3} .+ → ", frame)
    assert len(samples) == 2            # the latest generation's: 8 completions of 2 prompts, one shown per prompt


def test_a_dashboard_that_breaks_mid_run_hands_over_to_plain_lines(tiny_config, tmp_path, monkeypatch, capsys):
    from mudpuppy import create_backend, load_config, run

    drawn = dashboard.render

    def breaks_at_step_4(state, *args, **kwargs):
        if state.step >= 4:
            raise RuntimeError("drawing broke")
        return drawn(state, *args, **kwargs)

    monkeypatch.setattr(dashboard, "render", breaks_at_step_4)
    cfg = load_config(write_config(tiny_config, tmp_path, steps=12, progress_every=1))
    console = Console(file=io.StringIO(), force_terminal=True, width=120, height=40)
    with watch_run(True, console=console, refresh_per_second=50) as echo:
        result = run(cfg, create_backend("cpu"), echo=echo)
    out, err = capsys.readouterr()
    assert result.steps == 12 and (tmp_path / "run" / "run_summary.json").exists()
    assert err.count("warning: the --tui dashboard failed (RuntimeError: drawing broke)") == 1
    first = re.search(r"train step (\d+)/12", err)
    assert first and 4 <= int(first.group(1)) < 12, err                 # plain lines from where drawing stopped
    assert "train step 12/12 (100%)" in err
    assert "data: 64 train / 16 held-out examples" in out and "after training:" in out   # the log, replayed
