"""`mudpuppy.quantization.gptq`: GPTQ for one weight matrix, over a model layer by layer, and its files,
re-exported from where the torch code lives (backends/torch/quantization/gptq/: sweep.py, layers.py, files.py)."""

from __future__ import annotations

from ..backends.torch.quantization.gptq.files import SHARD_BYTES, load_host_model, save_quantized
from ..backends.torch.quantization.gptq.layers import (
    BATCH_TOKENS, Calibration, GptqReport, SetReport, calibration_batches, capture_inputs, collect_hessians,
    find_decoder_layers, find_input_sets, plan_linears, quantize_model, quantize_set, real_rows,
    round_to_nearest_model, select_linears,
)
from ..backends.torch.quantization.gptq.sweep import (
    BLOCK, Factor, QuantizedWeight, QuantSpec, SweepResult, find_params, fp16_scale, gptq_quantize,
    inverse_hessian_factor, output_error, quantize_column, round_to_nearest,
)

__all__ = [
    "BATCH_TOKENS", "BLOCK", "Calibration", "Factor", "GptqReport", "QuantSpec", "QuantizedWeight", "SHARD_BYTES",
    "SetReport", "SweepResult", "calibration_batches", "capture_inputs", "collect_hessians", "find_decoder_layers",
    "find_input_sets", "find_params", "fp16_scale", "gptq_quantize", "inverse_hessian_factor", "load_host_model",
    "output_error", "plan_linears", "quantize_column", "quantize_model", "quantize_set", "real_rows",
    "round_to_nearest", "round_to_nearest_model", "save_quantized", "select_linears",
]
