"""What the README says, checked: its Python example runs verbatim after `make demo` (issue 39: it ended in a
traceback because the demo's output folder existed), and its torch-vs-MLX tolerances are the parity tests'.

The example reads configs/quickstart.yaml from the current directory; here that directory is a scratch one
whose configs/quickstart.yaml is the shipped file with the tiny test model in place of SmolLM2-135M and a
sample of the same data (the real model would take minutes). The block itself runs as the README prints it."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import yaml
from click.testing import CliRunner

from mudpuppy.cli import main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def tiny_quickstart(folder: Path, model_dir: Path) -> None:
    cfg = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text(encoding="utf-8"))
    cfg["model"]["base_model"] = str(model_dir)
    data = ROOT / "configs" / "data"
    cfg["data"]["datasets"] = [{"path": str(data / "smart_home_train.jsonl"), "num_samples": 16}]
    cfg["data"]["val_datasets"] = [{"path": str(data / "smart_home_val.jsonl"), "num_samples": 8}]
    cfg["data"]["sequence_len"] = 128
    cfg["training"].update(epochs=1, micro_batch_size=4, precision="fp32")
    cfg["eval"].update(max_samples=8, max_new_tokens=4)
    cfg["logging"] = {"progress_bar": False}
    (folder / "configs").mkdir()
    (folder / "configs" / "quickstart.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")


def snapshot(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


def run_block(block: str) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, "README.md", "exec"), {"__name__": "readme"})
    return printed.getvalue()


def test_the_python_example_runs_verbatim_after_make_demo(tiny_model_dir, tmp_path, monkeypatch):
    (block,) = python_blocks()
    monkeypatch.chdir(tmp_path)
    tiny_quickstart(tmp_path, tiny_model_dir)
    demo = CliRunner().invoke(main, ["run", "--config", "configs/quickstart.yaml", "--overwrite"])  # make demo's run
    assert demo.exit_code == 0, demo.output
    before = snapshot(tmp_path / "outputs" / "quickstart")
    for _ in range(2):                          # and again: a reader runs an example more than once
        last = run_block(block).strip().splitlines()[-1]
        exact_match, output_dir = last.split(" ", 1)
        assert 0.0 <= float(exact_match) <= 1.0
        assert (Path(output_dir) / "adapter_model.safetensors").is_file()
    assert Path(output_dir).resolve() != (tmp_path / "outputs" / "quickstart").resolve()
    assert snapshot(tmp_path / "outputs" / "quickstart") == before          # the demo's run is untouched


def test_the_parity_tolerances_are_the_tests():
    tests = (ROOT / "tests" / "backends" / "mlx" / "test_parity.py").read_text(encoding="utf-8")
    logits = re.search(r"^LOGITS_TOL = (\S+)", tests, re.M)[1]
    losses = re.search(r"^LOSS_TOL = (\S+)", tests, re.M)[1]
    readme = " ".join(README.read_text(encoding="utf-8").split())
    assert f"torch and MLX agree on logits to {logits}" in readme
    assert f"ten steps' losses to {losses}" in readme


def test_the_quickstart_claim_is_the_slow_tests():
    """The demo's claim is what tests/slow/test_quickstart.py asserts, not a figure without its date."""
    slow = (ROOT / "tests" / "slow" / "test_quickstart.py").read_text(encoding="utf-8")
    below = float(re.search(r'before\["exact_match"\] < ([\d.]+)', slow)[1])
    above = float(re.search(r'after\["exact_match"\] >= ([\d.]+)', slow)[1])
    limit = int(re.search(r"assert seconds < (\d+)", slow)[1])
    readme = " ".join(README.read_text(encoding="utf-8").split())
    words = {600: "ten minutes"}
    assert f"exact match from under {below:.0%}" in readme and f"to at least {above:.0%}" in readme
    assert f"in under {words.get(limit, f'{limit} s')} on two CPU cores" in readme
    assert "tests/slow/test_quickstart.py" in readme and "1.5 minutes" not in readme
