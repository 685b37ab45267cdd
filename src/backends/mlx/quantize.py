"""The 4-bit base of QLoRA on MLX, with MLX's own quantization (`mx.quantize`).

Two formats: ``int4`` is MLX's affine 4-bit (a scale and an offset per group
of 64 values, mlx-lm's default), ``mxfp4`` the OCP microscaling FP4 format
(groups of 32 sharing a power-of-two scale). As in QLoRA, only the linear
layers of the blocks are quantized; the embeddings and the output head keep
full precision, and the LoRA weights on top stay in float32.
"""

from __future__ import annotations

from mlx import nn

from ...errors import MudpuppyError
from .layers import HEAD_LEAVES

# quant_backend -> (mode, bits, group size), the values mx.quantize documents for each mode.
FORMATS = {
    "int4": ("affine", 4, 64),
    "mxfp4": ("mxfp4", 4, 32),
}


def quantize_base(model: nn.Module, quant_backend: str = "int4") -> dict:
    """Quantize the model's linear layers in place; returns what was done, for the run report.

    A layer whose input width is not a multiple of the group size cannot be
    quantized in this format and stays in full precision (mlx-lm's converter
    does the same); if that leaves nothing quantized, that is an error.
    """
    if quant_backend not in FORMATS:
        raise MudpuppyError(f"adapter.quant_backend {quant_backend!r} is not available on MLX; "
                            f"choose one of: {', '.join(FORMATS)}")
    mode, bits, group_size = FORMATS[quant_backend]
    chosen, skipped = [], []

    def pick(path: str, module: nn.Module) -> bool:
        if not isinstance(module, nn.Linear) or path.rsplit(".", 1)[-1] in HEAD_LEAVES:
            return False
        if module.weight.shape[-1] % group_size:
            skipped.append(path)
            return False
        chosen.append(path)
        return True

    nn.quantize(model, group_size=group_size, bits=bits, mode=mode, class_predicate=pick)
    if not chosen:
        raise MudpuppyError(f"adapter.quant_backend {quant_backend}: no linear layer has an input width "
                            f"divisible by {group_size}, so nothing can be quantized in this format")
    return {"quant_backend": quant_backend, "mode": mode, "bits": bits, "group_size": group_size,
            "quantized": len(chosen), "kept_full_precision": skipped}
