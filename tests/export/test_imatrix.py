"""Importance matrices: llama.cpp's two file forms read as llama-quantize normalizes them, the GGUF form
written, and one collected from a tiny model equal to the inputs' squares computed by hand."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from mudpuppy.errors import MudpuppyError
from mudpuppy.export.imatrix import (Stats, gguf_entries, quant_weights, read_imatrix, stats_for_model,
                                     write_imatrix)


def legacy_bytes(entries: dict[str, tuple[int, np.ndarray]], chunks: int | None, dataset: str | None) -> bytes:
    """A .dat as tools/imatrix/imatrix.cpp save_imatrix_legacy writes it (values already mean * ncall)."""
    out = struct.pack("<i", len(entries))
    for name, (ncall, values) in entries.items():
        raw = name.encode()
        out += struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, values.size)
        out += values.astype("<f4").tobytes()
    if chunks is not None:
        out += struct.pack("<i", chunks)
        if dataset is not None:
            out += struct.pack("<i", len(dataset)) + dataset.encode()
    return out


def test_legacy_dat_is_divided_by_ncall(tmp_path):
    a = np.array([3.0, 6.0, 0.0, 1.5], np.float32)
    b = np.array([2.0, 4.0], np.float32)
    path = tmp_path / "imatrix.dat"
    path.write_bytes(legacy_bytes({"blk.0.attn_q.weight": (3, a), "output.weight": (0, b)}, 12, "train.txt"))
    got = read_imatrix(path)
    np.testing.assert_array_equal(got.weights["blk.0.attn_q.weight"], a / np.float32(3))
    np.testing.assert_array_equal(got.weights["output.weight"], b)        # ncall 0: taken as is
    assert got.chunk_count == 12 and got.datasets == ["train.txt"]
    path.write_bytes(legacy_bytes({"x.weight": (1, a)}, None, None))       # the trailer is optional
    assert read_imatrix(path).chunk_count == 0
    path.write_bytes(legacy_bytes({"x.weight": (1, a)}, None, None)[:-3])
    with pytest.raises(MudpuppyError, match="ends early"):
        read_imatrix(path)


def test_gguf_form_round_trips_as_llama_quantize_reads_it(tmp_path):
    import gguf

    sums = np.array([[4.0, 8.0, 2.0], [1.0, 1.0, 1.0]])
    stats = {"blk.0.ffn_down_exps.weight": Stats(sums, np.array([4, 0])),
             "blk.0.attn_q.weight": Stats(np.array([[9.0, 3.0]]), np.array([3]))}
    path = tmp_path / "imatrix.gguf"
    write_imatrix(path, stats, ["calib.jsonl"], chunk_count=5, chunk_size=512)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    assert sorted(tensors) == ["blk.0.attn_q.weight.counts", "blk.0.attn_q.weight.in_sum2",
                               "blk.0.ffn_down_exps.weight.counts", "blk.0.ffn_down_exps.weight.in_sum2"]
    assert list(tensors["blk.0.ffn_down_exps.weight.in_sum2"].shape) == [3, 2]   # ggml ne: cols, n_mat
    assert reader.fields["imatrix.chunk_size"].contents() == 512
    got = read_imatrix(path)
    # per expert: sums / count; an expert never routed to gets 1 (quantize.cpp load_imatrix)
    np.testing.assert_array_equal(got.weights["blk.0.ffn_down_exps.weight"], [1.0, 2.0, 0.5, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(got.weights["blk.0.attn_q.weight"], [3.0, 1.0])
    assert got.datasets == ["calib.jsonl"] and got.chunk_count == 5


def test_a_gguf_model_is_not_an_imatrix(tmp_path):
    import gguf

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("x.in_sum2", np.ones((1, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(MudpuppyError, match="without the imatrix keys"):
        read_imatrix(path)
    with pytest.raises(MudpuppyError, match="no such file"):
        read_imatrix(tmp_path / "missing.dat")


def test_collected_from_a_tiny_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from mudpuppy.backends.torch.quantization.imatrix import collect_input_squares

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    sequences = [[1, 5, 9, 13, 2], [7, 3, 3, 8]]
    got = collect_input_squares(model, sequences)
    layer = model.model.layers[0]
    expect_q = np.zeros(model.config.hidden_size)
    expect_head = np.zeros(model.config.hidden_size)
    with torch.no_grad():
        for ids in sequences:
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
            x = layer.input_layernorm(model.model.embed_tokens(torch.tensor([ids])))[0].double()
            expect_q += (x * x).sum(0).numpy()
            h = out.hidden_states[-1][0].double()              # after the final norm: lm_head's input
            expect_head += (h * h).sum(0).numpy()
    total, rows = got["model.layers.0.self_attn.q_proj"]
    assert rows == 9
    np.testing.assert_allclose(total, expect_q, rtol=1e-6)
    np.testing.assert_allclose(got["lm_head"][0], expect_head, rtol=1e-6)
    assert got["model.layers.1.mlp.down_proj"][0].shape == (model.config.intermediate_size,)
    assert collect_input_squares(model, sequences, max_tokens=6)["lm_head"][1] == 6
    # Equal-length sequences run as one batch, the head's logits are skipped: the sums are those of each
    # sequence alone (the loop above), with a batch split by the token budget and a shorter one apart.
    same = [[1, 5, 9, 13], [7, 3, 3, 8], [2, 4, 6, 8], [9, 9]]
    alone = {}
    for ids in same:
        for name, (total, n) in collect_input_squares(model, [ids], batch_tokens=1).items():
            prev = alone.get(name, (0.0, 0))
            alone[name] = (prev[0] + total, prev[1] + n)
    batched = collect_input_squares(model, same, batch_tokens=8)
    assert batched.keys() == alone.keys() and batched["lm_head"][1] == 14
    for name, (total, n) in batched.items():
        assert n == alone[name][1]
        np.testing.assert_allclose(total, alone[name][0], rtol=1e-6)

    entries = gguf_entries(got, "LLAMA", model.config.num_hidden_layers, head_is_token_embd=True)
    assert {"blk.0.attn_q.weight", "blk.1.ffn_down.weight", "token_embd.weight"} <= set(entries)
    assert "output.weight" not in entries
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert set(stats_for_model(got, config, "tiny")) == set(entries)         # tied head, llama: no output.weight
    assert set(gguf_entries(got, "LLAMA", 2, head_is_token_embd=False)) - set(entries) == {"output.weight"}
    np.testing.assert_allclose(quant_weights(entries)["blk.0.attn_q.weight"], (expect_q / 9).astype(np.float32),
                               rtol=1e-6)
