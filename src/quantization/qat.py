"""`mudpuppy.quantization.qat`: quantization-aware training's prepare/convert and the converted model's
files, re-exported from where the torch code lives (backends/torch/quantization/qat/: layers.py, files.py)."""

from __future__ import annotations

from ..backends.torch.quantization.qat.files import is_qat_checkpoint, load_quantized, read_quantization_config, save_quantized
from ..backends.torch.quantization.qat.layers import (
    FORMAT_VERSION, QUANT_METHOD, QatLayers, QatSpec, check_adapter, check_group_size, convert_qat,
    lora_merged_weight, prepare_qat, set_fake_quant,
)

__all__ = [
    "FORMAT_VERSION", "QUANT_METHOD", "QatLayers", "QatSpec", "check_adapter", "check_group_size", "convert_qat",
    "is_qat_checkpoint", "load_quantized", "lora_merged_weight", "prepare_qat", "read_quantization_config",
    "save_quantized", "set_fake_quant",
]
