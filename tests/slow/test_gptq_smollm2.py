"""GPTQ on the real SmolLM2-135M-Instruct (configs/gptq.yaml): 4-bit, groups of 128, held-out loss below
round-to-nearest's at the same bits and groups, both against the unquantized model evaluated in bf16.
Minutes on a CPU."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mudpuppy.cli import main

from ..conftest import REPO

pytestmark = pytest.mark.slow


def test_gptq_4bit_g128_beats_round_to_nearest(tmp_path):
    out = tmp_path / "gptq"
    res = CliRunner().invoke(main, ["run", "-c", str(REPO / "configs" / "gptq.yaml"), "--backend", "cpu",
                                    "--set", f"output_dir={out}", "--set", "training.precision=bf16"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "run_summary.json").read_text())
    qc = summary["quantization_config"]
    assert (qc["bits"], qc["group_size"], qc["quant_method"]) == (4, 128, "gptq")
    loss = summary["heldout_loss"]
    bf16, rtn, gptq = loss["original"], loss["round_to_nearest"], loss["gptq"]
    print(f"\nheld-out loss, SmolLM2-135M-Instruct, 4-bit g128: bf16 {bf16:.4f}, round-to-nearest {rtn:.4f} "
          f"({rtn - bf16:+.4f}), GPTQ {gptq:.4f} ({gptq - bf16:+.4f})")
    # Measured in fp32 (docs/gptq.md): original 5.785, round-to-nearest 6.497, GPTQ 6.349.
    assert gptq < rtn - 0.05
    assert summary["gptq"]["rtn_fallback"] == []
    assert summary["gptq"]["linears"] == 30 * 7
    assert "round-to-nearest" in res.output and "GPTQ" in res.output
