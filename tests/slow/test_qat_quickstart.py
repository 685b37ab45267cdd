"""configs/qat.yaml on the real SmolLM2-135M-Instruct: after conversion to int4, QAT's held-out loss is below
round-to-nearest PTQ of the same fine-tune, and the saved model reloads to the same numbers. Minutes on a CPU."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mudpuppy.cli import main

from ..conftest import REPO

pytestmark = pytest.mark.slow


def test_qat_beats_round_to_nearest_ptq_on_the_quickstart_task(tmp_path):
    import torch

    from mudpuppy.quantization.qat import load_quantized

    out = tmp_path / "qat"
    res = CliRunner().invoke(main, ["run", "-c", str(REPO / "configs" / "qat.yaml"),
                                    "--set", f"output_dir={out}", "--set", "logging.progress_bar=false"])
    assert res.exit_code == 0, res.output
    held = json.loads((out / "run_summary.json").read_text())["qat"]["heldout"]
    ptq, converted = held["ptq_round_to_nearest"], held["qat_converted"]
    assert converted["loss"] < ptq["loss"], held
    assert converted["exact_match"] >= ptq["exact_match"], held
    assert converted["exact_match"] >= 0.9, held
    # the int4 model on disk: 4-bit codes, and it loads back into a working model
    model = load_quantized(out)
    layer = model.model.layers[0].self_attn.q_proj
    assert layer.bits == 4 and layer.qweight.dtype == torch.int8 and int(layer.qweight.abs().max()) <= 8
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
