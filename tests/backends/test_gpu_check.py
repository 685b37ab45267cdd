"""benchmarks/gpu_check.py, run end to end on the CPU as a CI test of the script itself.

The parity rows are checked here against the committed reference
(benchmarks/results/gpu_check_reference.json) by this test's own arithmetic, not
only by the script's verdict; a tampered reference must turn the exit code to 1.
After a deliberate change to training numerics, regenerate the reference with
`python benchmarks/gpu_check.py --device cpu --write-reference --sections parity`.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from ..conftest import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.py"
REFERENCE = REPO / "benchmarks" / "results" / "gpu_check_reference.json"
SECTIONS = ("environment", "parity", "dequantize", "scale", "methods")


def run_check(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def largest_gap(row: dict, expected: dict) -> float:
    gaps = [abs(a - b) for a, b in zip(row["losses"], expected["losses"], strict=True)]
    assert sorted(row["adapter"]) == sorted(expected["adapter"])
    for name, values in row["adapter"].items():
        gaps += [abs(a - b) for a, b in zip(values, expected["adapter"][name], strict=True)]
    return max(gaps)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    done = run_check("--quick", "--out", str(out))
    return done, json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text()


def test_quick_cpu_run_reports_every_section_and_passes(quick_run):
    done, report, markdown = quick_run
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert set(report["sections"]) == set(SECTIONS)
    for name in SECTIONS:
        assert report["sections"][name]["ok"], (name, report["sections"][name])
        assert f"## {name}: ok" in markdown
    env = report["sections"]["environment"]
    assert env["torch"] and env["attention"] and env["gpu_tests"] == {"skipped": "--device cpu"}
    dequantize = report["sections"]["dequantize"]
    assert {(r["format"], r["dtype"], r["autocast"]) for r in dequantize["rows"]} == {
        (f, d, a) for f in ("int4", "mxfp4") for d in ("bfloat16", "float16") for a in (False, True)}
    assert "unique_graphs" in dequantize["dynamo_counters"]["stats"]
    sides = {r["side"] for r in report["sections"]["scale"]["rows"] if r["tokens_per_second"] > 0}
    assert sides == {"mudpuppy-qlora-int4", "mudpuppy-lora-bf16", "trl-peft-lora-bf16"}
    assert report["sections"]["scale"]["ratios"]
    methods = report["sections"]["methods"]
    assert methods["grpo_sampling"]["tokens_per_second"] > 0 and methods["dpo_step"]["loss"] is not None


def test_quick_cpu_parity_matches_the_committed_reference(quick_run):
    _, report, _ = quick_run
    reference = json.loads(REFERENCE.read_text())["parity"]
    parity = report["sections"]["parity"]
    rows = {r["name"]: r for r in parity["rows"]}
    assert set(rows) | set(parity["skipped"]) == set(reference)
    trained = [name for name, row in rows.items() if "losses" in row]
    assert {"lora", "lora_no_clip", "qlora_int4", "qlora_mxfp4"} <= set(trained)
    for name in trained:
        assert len(rows[name]["losses"]) == 5
        assert largest_gap(rows[name], reference[name]) <= 1e-4, name
    for name, row in rows.items():
        if "refused" in row:       # the memory options are GPU-only: refused here and in the reference alike
            assert row["refused"].startswith("refused on cpu: memory.") and "refused" in reference[name]


def test_a_tampered_reference_makes_the_exit_code_1(tmp_path):
    reference = json.loads(REFERENCE.read_text())
    reference["parity"]["lora"]["losses"][2] += 1e-3
    tampered = tmp_path / "reference.json"
    tampered.write_text(json.dumps(reference))
    done = run_check("--sections", "parity", "--rows", "lora", "--reference", str(tampered), "--out", str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    row = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["parity"]["rows"][0]
    assert row["name"] == "lora" and not row["ok"] and row["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert "| lora | FAIL |" in (tmp_path / "gpu_check.md").read_text()


def test_a_gpu_compares_refused_rows_with_their_cpu_equivalent_or_its_own_twin():
    check = load_script()
    reference = json.loads(REFERENCE.read_text())
    lora, no_clip = reference["parity"]["lora"], reference["parity"]["lora_no_clip"]
    streamed = check.compare_row("stream_layers", lora, reference, None, on_cpu=False)
    assert streamed["ok"] and "'lora'" in streamed["against"]
    off = {**no_clip, "losses": [x + 2e-4 for x in no_clip["losses"]]}
    assert not check.compare_row("optimizer_offload_no_clip", off, reference, None, on_cpu=False)["ok"]
    # Dropout masks come from the device's RNG: compared with the same config without offload on the device.
    twin = {**lora, "losses": [x + 1.0 for x in lora["losses"]]}
    offloaded = check.compare_row("activation_offload_dropout", twin, reference, twin, on_cpu=False)
    assert offloaded["ok"] and "no CPU reference" in offloaded["against"]
    assert not check.compare_row("activation_offload_dropout", lora, reference, twin, on_cpu=False)["ok"]
    refused = {"refused": "refused on cuda: no"}
    assert not check.compare_row("lora", refused, reference, None, on_cpu=False)["ok"]


def test_a_gpu_asked_for_where_there_is_none_exits_2():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "no CUDA or ROCm GPU here" in done.stderr
