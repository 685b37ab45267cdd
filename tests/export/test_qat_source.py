"""A converted QAT model (quantization/qat.py's layout, packed here by the test) exports as the float32
weights its codes and scales stand for."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from mudpuppy.export import ExportRequest, export_model

from .conftest import export_quantized

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize(("bits", "group"), [(4, 16), (8, -1)])
def test_a_converted_qat_model_exports_as_its_dequantized_weights(tiny_model_dir, tmp_path, bits, group):
    from safetensors.numpy import load_file

    src = tmp_path / "qat"
    plain = load_file(str(tiny_model_dir / "model.safetensors"))
    top = 2 ** (bits - 1) - 1
    tensors, expected, modules = {}, {}, []
    for name, w in plain.items():
        base, leaf = name.rsplit(".", 1)
        if base.rsplit(".", 1)[-1] not in LINEARS or leaf != "weight":
            tensors[name] = expected[name] = w
            continue
        out_f, in_f = w.shape
        size = in_f if group == -1 else group
        blocks = w.reshape(out_f, in_f // size, size)
        scales = (np.abs(blocks).max(-1) / top).astype(np.float32)             # [out, in / size]
        codes = np.clip(np.round(blocks / scales[..., None]), -top - 1, top).astype(np.int8).reshape(out_f, in_f)
        expected[name] = (codes.reshape(out_f, -1, size) * scales[..., None]).reshape(out_f, in_f).astype(np.float32)
        if bits == 4:                       # code + 8, the even column in the low nibble
            u = (codes.astype(np.int16) + 8).astype(np.uint8)
            codes = u[:, 0::2] | (u[:, 1::2] << 4)
        tensors[f"{base}.qweight"], tensors[f"{base}.scales"] = codes, scales
        modules.append(base)
    _, merged = export_quantized(tiny_model_dir, src, tensors, {
        "quant_method": "mudpuppy_qat", "format_version": 1, "weight_bits": bits, "group_size": group,
        "symmetric": True, "activations": "none", "modules": modules})
    assert set(merged) == set(expected)
    for name, value in merged.items():
        np.testing.assert_allclose(value, expected[name], atol=1e-6, rtol=0, err_msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert np.abs(merged[q] - plain[q]).max() > 1e-4          # the codes moved the weights


def test_the_export_of_a_real_conversion_computes_what_the_converted_model_computes(tiny_model_dir, tmp_path):
    """The writer (quantization/qat.py) and this reader agree: transformers on the export = mudpuppy's kernels."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from mudpuppy.quantization.qat import QatSpec, convert_qat, prepare_qat, save_quantized

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():                               # a trained-looking adapter, so its merge matters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    converted = convert_qat(model.eval(), prepare_qat(model, QatSpec(4, 32)))
    save_quantized(converted, None, tmp_path / "q")
    for f in tiny_model_dir.glob("tokenizer*"):
        shutil.copy(f, tmp_path / "q" / f.name)

    export_model(ExportRequest(str(tmp_path / "q"), "merged", str(tmp_path / "out"), dtype="fp32"),
                 echo=lambda *_a, **_k: None)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert getattr(exported.config, "quantization_config", None) is None
    ids = torch.randint(0, exported.config.vocab_size, (2, 11))
    with torch.no_grad():
        got, want = exported(input_ids=ids).logits, converted(input_ids=ids).logits
    assert (got - want).abs().max() <= 1e-5
