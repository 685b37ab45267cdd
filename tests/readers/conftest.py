"""The models the readers tier exports: each family of tests/export/test_gguf_families.py at a width
where K-quants are K-quants (hidden 256, FFN 512: every matrix whose rows are 256 or 512 long gets
its 256-value super-blocks; attention outputs of 64 columns fall back as llama.cpp's rules say) and 4
layers (llama-quantize's use_more_bits picks layers 0, 2 and 3 of 4, so the per-layer rules show).
Built once per session; exports cached by (family, quant)."""

from __future__ import annotations

import json

import pytest

from mudpuppy.export import ExportRequest, export_model

from ..export.test_gguf_families import FAMILIES, build

WIDE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4)
EXTRA = {"qwen3moe": dict(moe_intermediate_size=256)}
TEXT = ("turn on the kitchen lights and then switch off the bedroom fan please, "
        "and tell me what the weather will be like tomorrow in the garden")
QUIET = dict(echo=lambda *_a, **_k: None)


class Models:
    def __init__(self, root):
        self.root = root
        self.built: dict = {}
        self.files: dict = {}

    def model(self, family: str):
        """(torch model, tokenizer, source directory, config dict) of `family`."""
        if family not in self.built:
            # not named after the family: llama.cpp gives a model whose general.name contains "phi3" Phi-3's
            # token attributes, and its loader then fails on this tokenizer (test_gguf_families.exports)
            src = self.root / f"tiny-{list(FAMILIES).index(family)}"
            model, tok = build(family, src, **{**WIDE, **EXTRA.get(family, {})})
            self.built[family] = (model, tok, src, json.loads((src / "config.json").read_text()))
        return self.built[family]

    def gguf(self, family: str, quant: str, imatrix=None):
        """mudpuppy's GGUF of `family` at `quant` (`imatrix`: a file for --imatrix)."""
        key = (family, quant, str(imatrix))
        if key not in self.files:
            _, _, src, _ = self.model(family)
            out = self.root / f"{family}-{quant}{'-imatrix' if imatrix else ''}"
            export_model(ExportRequest(str(src), "gguf", str(out), quant=quant,
                                       imatrix=None if imatrix is None else str(imatrix)), **QUIET)
            self.files[key] = out / f"model-{quant}.gguf"
        return self.files[key]

    def dequantized(self, family: str, quant: str):
        """mudpuppy's dequantized forward: the source model computing with the weights stored in its GGUF
        at `quant`, each tensor dequantized by gguf-py and put back under the source's names by the
        export's own inverse of the writer's plan (export/quality.py, what the export's report scores).
        This is what llama.cpp should compute from the file, up to its float arithmetic (and its quantized
        activations in quantized matrix products)."""
        import torch
        from transformers import AutoModelForCausalLM

        from mudpuppy.export.quality import write_dequantized

        _, _, src, _ = self.model(family)
        target = self.root / f"{family}-{quant}-dequantized"
        if not (target / "config.json").is_file():
            write_dequantized(self.gguf(family, quant), src, target)
        return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    return Models(tmp_path_factory.mktemp("readers"))


ALL_FAMILIES = list(FAMILIES)
