"""The 4-bit base of QLoRA on MLX, with MLX's own quantization (`mx.quantize`).

Two formats: ``int4`` is MLX's affine 4-bit (a scale and an offset per group
of 64 values, mlx-lm's default), ``mxfp4`` the OCP microscaling FP4 format
(groups of 32 sharing a power-of-two scale). As in QLoRA, only the linear
layers of the blocks are quantized; the embeddings and the output head keep
full precision, and the LoRA weights on top stay in float32.

`load_model` calls `quantize_base` on lazily loaded weights (see loading.py),
so each layer is quantized as it is read; `MlxBackend.quantize_base` calls it
on a model loaded without the adapter. Both run the same operations on the
same values, so both give the same 4-bit base.
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


def quant_format(adapter_cfg) -> str:
    """The adapter's 4-bit format, refused here (before any weight is read) when MLX cannot give it."""
    name = getattr(adapter_cfg, "quant_backend", None) or "int4"
    group = getattr(adapter_cfg, "quant_group_size", 64)
    if name == "int4" and group != 64:
        # mx.quantize's affine mode is used with its group of 64; say so rather than differ silently.
        raise MudpuppyError(f"adapter.quant_group_size {group} is not available on MLX; "
                            "MLX's int4 (affine) quantization uses groups of 64")
    if name not in FORMATS:
        raise MudpuppyError(f"adapter.quant_backend {name!r} is not available on MLX; "
                            f"choose one of: {', '.join(FORMATS)}")
    return name


def quantize_base(model: nn.Module, quant_backend: str = "int4") -> dict:
    """Quantize the model's linear layers and expert stacks in place; returns what was done, for the run report.

    A layer whose input width is not a multiple of the group size cannot be
    quantized in this format and stays in full precision (mlx-lm's converter
    does the same); if that leaves nothing quantized, that is an error.
    """
    if quant_backend not in FORMATS:
        raise MudpuppyError(f"adapter.quant_backend {quant_backend!r} is not available on MLX; "
                            f"choose one of: {', '.join(FORMATS)}")
    mode, bits, group_size = FORMATS[quant_backend]
    chosen, skipped = [], []

    from mlx_lm.models.switch_layers import SwitchLinear

    from .experts import router_paths

    routers = router_paths(model)     # full precision, as on torch (its routers are no linear layers)

    def pick(path: str, module: nn.Module) -> bool:
        # Linear layers and mixture-of-experts stacks (SwitchLinear: most of such a model's weights).
        if (not isinstance(module, (nn.Linear, SwitchLinear)) or path.rsplit(".", 1)[-1] in HEAD_LEAVES
                or path in routers):
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
