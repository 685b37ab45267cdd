"""The TensorBoard tracker writes event files without torch, and TensorBoard's own reader finds in them what
torch.utils.tensorboard's SummaryWriter (what the tracker used before) writes for the same calls."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from mudpuppy.monitor.trackers import TensorBoard, flatten  # noqa: E402

CONFIG = {"method": "sft", "training": {"max_steps": 3, "learning_rate": 0.005}, "logging": {"report_to": ["x"]}}
STEPS = {1: {"loss": 2.5, "lr": 0.005, "grad_norm": 1.25}, 2: {"loss": 2.0625, "lr": 0.004}, 3: {"eval_loss": 1.75}}
SUMMARY = {"final_loss": 2.0625, "eval_after": {"loss": 1.75}, "method": "sft"}


def read(logdir: Path) -> dict:
    """Everything TensorBoard shows of a log directory: each scalar series, and the text summaries."""
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    tags = acc.Tags()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags["scalars"]}
    texts = {tag: [b.decode() for e in acc.Tensors(tag) for b in e.tensor_proto.string_val]
             for tag in tags["tensors"]}
    return {"scalars": scalars, "texts": texts}


def write_with_tracker(out: Path) -> None:
    tracker = TensorBoard(out, "run", CONFIG, "mudpuppy")
    for step, values in STEPS.items():
        tracker.log(step, values)
    tracker.finish(SUMMARY)


def test_the_event_files_read_back_as_summary_writer_wrote_them(tmp_path):
    torch_tb = pytest.importorskip("torch.utils.tensorboard")
    from mudpuppy.monitor.trackers import flatten_numbers, numeric

    write_with_tracker(tmp_path / "ours")
    writer = torch_tb.SummaryWriter(log_dir=str(tmp_path / "torch" / "tensorboard"))      # the former tracker
    table = "\n".join(f"| {k} | {v} |" for k, v in flatten(CONFIG).items())
    writer.add_text("config", "| key | value |\n| --- | --- |\n" + table, 0)
    for step, values in STEPS.items():
        for key, value in values.items():
            writer.add_scalar(key, value, step)
    for key, value in numeric(flatten_numbers(SUMMARY)).items():
        writer.add_scalar(f"summary/{key}", value, 0)
    writer.close()

    ours, theirs = read(tmp_path / "ours" / "tensorboard"), read(tmp_path / "torch" / "tensorboard")
    assert ours == theirs
    assert ours["scalars"]["loss"] == [(1, 2.5), (2, 2.0625)]
    assert ours["scalars"]["summary/eval_after.loss"] == [(0, 1.75)]
    assert "| training.max_steps | 3 |" in ours["texts"]["config/text_summary"][0]


def test_it_writes_where_torch_cannot_be_imported(tmp_path):
    # A process in which `import torch` fails (as on a machine with MLX alone): the tracker still writes.
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None
        from pathlib import Path
        from mudpuppy.monitor.trackers import TensorBoard
        t = TensorBoard(Path({str(tmp_path)!r}), "run", {CONFIG!r}, "mudpuppy")
        for step, values in {STEPS!r}.items():
            t.log(step, values)
        t.finish({SUMMARY!r})
        print("torch" in sys.modules and sys.modules["torch"] is not None)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "False"
    got = read(tmp_path / "tensorboard")
    expected = {f"summary/{k}": v for k, v in {"final_loss": 2.0625, "eval_after.loss": 1.75}.items()}
    assert got["scalars"] == {
        "loss": [(1, 2.5), (2, 2.0625)], "lr": [(1, pytest.approx(0.005)), (2, pytest.approx(0.004))],
        "grad_norm": [(1, 1.25)], "eval_loss": [(3, 1.75)], **{k: [(0, v)] for k, v in expected.items()}}
    assert got["texts"]["config/text_summary"][0].startswith("| key | value |")
