"""`export --imatrix auto`: the importance matrix comes from the run's own training data through the
merged model, is written beside the GGUF in llama-imatrix's form, and weights the K-quant blocks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mudpuppy.export.calibrate import CHUNK, calibration_chunks

from .conftest import mudpuppy


class _Seq:
    def __init__(self, ids):
        self.input_ids = np.asarray(ids)

    def sequences(self):
        return [self]


def test_chunks_lay_the_examples_end_to_end_up_to_the_budget():
    train = [_Seq(range(0, 5)), _Seq(range(5, 12)), _Seq(range(12, 30))]
    assert calibration_chunks(train, chunk=4, tokens=10) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert calibration_chunks(train, chunk=8, tokens=100) == [list(range(0, 8)), list(range(8, 16)),
                                                              list(range(16, 24)), list(range(24, 30))]
    assert calibration_chunks([], chunk=4, tokens=10) == []


def test_auto_collects_from_the_run_writes_the_matrix_and_weights_the_blocks(lora_run, peft_merged, tmp_path):
    import gguf
    import torch

    from mudpuppy.export.imatrix import read_imatrix

    out = tmp_path / "auto"
    done = mudpuppy("export", lora_run, "--format", "gguf", "--quant", "q4_k_m", "--imatrix", "auto", "--out", out)
    assert done.exit_code == 0, done.output
    assert "importance matrix:" in done.output and "of the run's training data" in done.output
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "export.json", "imatrix.gguf", "model-q4_k_m.gguf"]
    record = json.loads((out / "export.json").read_text())
    assert record["gguf"]["imatrix_tensors"] > 0 and "imatrix.gguf" in record["files"]
    matrix = read_imatrix(out / "imatrix.gguf")
    assert matrix.chunk_count >= 1 and "blk.0.attn_q.weight" in matrix.weights

    # An independent oracle for one entry: attn_q's input is layer 0's input norm of the embeddings, which
    # the merged model's own forward gives; the chunks are the run's tokens end to end (one small run: all
    # of them fit the budget), so their mean square per column is the matrix's row.
    model, tok = peft_merged
    from mudpuppy import load_config
    from mudpuppy.data import prepare_data

    cfg = load_config(lora_run / "config.yaml", check_files=False)
    tokens = np.concatenate([np.asarray(e.sequences()[0].input_ids) for e in prepare_data(cfg, tok).train])
    squares, rows = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(tokens), CHUNK):
            ids = torch.tensor([tokens[i:i + CHUNK].tolist()])
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[0]
            x = model.model.layers[0].input_layernorm(hidden)[0].double()
            squares, rows = squares + (x * x).sum(0), rows + x.shape[0]
    assert matrix.chunk_count == -(-len(tokens) // CHUNK)
    np.testing.assert_allclose(matrix.weights["blk.0.attn_q.weight"], (squares / rows).numpy(), rtol=1e-5)

    plain = tmp_path / "plain"
    assert mudpuppy("export", lora_run, "--format", "gguf", "--quant", "q4_k_m", "--out", plain).exit_code == 0
    before = {t.name: bytes(t.data) for t in gguf.GGUFReader(str(plain / "model-q4_k_m.gguf")).tensors}
    after = {t.name: bytes(t.data) for t in gguf.GGUFReader(str(out / "model-q4_k_m.gguf")).tensors}
    assert before.keys() == after.keys() and any(before[k] != after[k] for k in before)


def test_auto_needs_a_run(tiny_model_dir, tmp_path):
    done = mudpuppy("export", tiny_model_dir, "--format", "gguf", "--quant", "q4_k_m", "--imatrix", "auto",
                    "--out", tmp_path / "x")
    assert done.exit_code == 2 and "--imatrix auto calibrates on a run's training data" in done.output
    assert not (tmp_path / "x").exists()
