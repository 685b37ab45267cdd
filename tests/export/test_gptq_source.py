"""A GPTQ checkpoint in the standard layout (packed here by the test, not by mudpuppy) exports as the
float32 weights its codes, zero points, scales and act-order groups stand for."""

from __future__ import annotations

import json

import numpy as np
import pytest

from .conftest import export_quantized

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 16


def pack_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """[n, m] codes -> int32 [n * bits / 32, m]: row j of each word-row in bits j*bits.."""
    per = 32 // bits
    words = np.zeros((codes.shape[0] // per, codes.shape[1]), dtype=np.uint32)
    for j in range(per):
        words |= codes[j::per].astype(np.uint32) << np.uint32(j * bits)
    return words.view(np.int32)


def pack_columns(codes: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    words = np.zeros((codes.shape[0], codes.shape[1] // per), dtype=np.uint32)
    for j in range(per):
        words |= codes[:, j::per].astype(np.uint32) << np.uint32(j * bits)
    return words.view(np.int32)


def quantize_linear(w: np.ndarray, bits: int, rng) -> tuple[dict, np.ndarray]:
    """Asymmetric per-group codes with an act-order column permutation; returns the standard tensors
    (original zero-point convention: stored zero = zero - 1) and the weight they stand for."""
    out_f, in_f = w.shape
    maxq = 2 ** bits - 1
    g_idx = (np.argsort(rng.permutation(in_f)) // GROUP).astype(np.int32)   # act-order: groups not contiguous
    groups = in_f // GROUP
    scales = np.zeros((groups, out_f), np.float16)
    zeros = np.zeros((groups, out_f), np.int64)
    codes = np.zeros((in_f, out_f), np.int64)
    for g in range(groups):
        cols = np.flatnonzero(g_idx == g)
        block = w[:, cols]
        lo, hi = np.minimum(block.min(1), 0), np.maximum(block.max(1), 0)
        scale = ((hi - lo) / maxq).astype(np.float16)
        zero = np.clip(np.round(-lo / scale.astype(np.float32)), 0, maxq).astype(np.int64)
        scales[g], zeros[g] = scale, zero
        codes[cols] = np.clip(np.round(block / scale.astype(np.float32)[:, None]) + zero[:, None], 0, maxq).T
    deq = (scales.astype(np.float32)[g_idx] * (codes - zeros[g_idx])).T
    stored = {"qweight": pack_rows(codes, bits), "qzeros": pack_columns(zeros - 1, bits), "scales": scales,
              "g_idx": g_idx}
    return stored, deq.astype(np.float32)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_gptq_model_exports_as_its_dequantized_weights(tiny_model_dir, tmp_path, bits):
    from safetensors.numpy import load_file

    rng = np.random.default_rng(bits)
    src = tmp_path / "gptq"
    plain = load_file(str(tiny_model_dir / "model.safetensors"))
    tensors, expected = {}, {}
    for name, value in plain.items():
        base, leaf = name.rsplit(".", 1)
        if base.rsplit(".", 1)[-1] in LINEARS and leaf == "weight":
            stored, expected[name] = quantize_linear(value, bits, rng)
            tensors.update({f"{base}.{k}": v for k, v in stored.items()})
        else:
            tensors[name] = expected[name] = value
    out, merged = export_quantized(tiny_model_dir, src, tensors, {
        "quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": True, "sym": False,
        "checkpoint_format": "gptq"})
    assert set(merged) == set(expected)
    for name, value in merged.items():
        np.testing.assert_allclose(value, expected[name], atol=1e-6, rtol=0, err_msg=name)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    # the codes moved the weights: this is not a copy of the float model
    q = "model.layers.0.self_attn.q_proj.weight"
    assert np.abs(merged[q] - plain[q]).max() > 1e-4
