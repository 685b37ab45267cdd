"""A frozen linear layer holding GPTQ tensors (`qweight`, `qzeros`, `scales`, `g_idx`), and the loading hook.

The layer is a `FrozenLinear` (model/frozen.py): its full weight is rebuilt from the codes for each use,
in the input's dtype, and dropped afterwards, and PEFT wraps it like any ``nn.Linear`` (LoRA on a
GPTQ base). The buffers are named and shaped as in a GPTQ checkpoint, so ``state_dict()`` of a
quantized model is the checkpoint itself and loading is a plain tensor-by-tensor read. Scales stay
fp16 whatever dtype the module is moved to: they are the checkpoint's values, and rounding them to
bf16 would change every weight of the group.

No kernel: dequantize-then-matmul in plain torch, so it runs on any device torch runs on (CPU,
ROCm, CUDA) without a compiled extension. That costs a weight-sized temporary per layer and use,
as QLoRA's `Linear4bit` does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from .....errors import MudpuppyError
from .format import (
    GptqSettings,
    PackedLinear,
    check_packable,
    dequantize_packed,
    read_quantization_config,
)
from ...model.frozen import FrozenLinear

BUFFERS = ("qweight", "qzeros", "scales", "g_idx")


class GptqLinear(FrozenLinear):
    costly_to_rebuild = False     # unpacking is cheap next to the matmul; keep no copy for the backward

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, bias: bool,
                 weight_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        bias_tensor = torch.zeros(out_features, dtype=torch.float16, device=device) if bias else None
        super().__init__(in_features, out_features, bias_tensor, weight_dtype)
        self.bits, self.group_size = bits, group_size
        groups = math.ceil(in_features / (group_size if group_size > 0 else in_features))
        self.register_buffer("qweight", torch.zeros(in_features * bits // 32, out_features, dtype=torch.int32,
                                                    device=device))
        self.register_buffer("qzeros", torch.zeros(groups, out_features * bits // 32, dtype=torch.int32,
                                                   device=device))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=torch.float16, device=device))
        self.register_buffer("g_idx", torch.zeros(in_features, dtype=torch.int32, device=device))

    @classmethod
    def from_packed(cls, packed: PackedLinear, bits: int, group_size: int,
                    weight_dtype: torch.dtype = torch.float32) -> GptqLinear:
        out_features = packed.scales.shape[1]
        in_features = packed.g_idx.shape[0]
        layer = cls(in_features, out_features, bits, group_size, packed.bias is not None, weight_dtype,
                    packed.qweight.device)
        for name in BUFFERS:
            setattr(layer, name, getattr(packed, name))
        if packed.bias is not None:
            layer.bias = nn.Parameter(packed.bias.to(weight_dtype), requires_grad=False)
        return layer

    @property
    def compute_device(self) -> torch.device:
        return self.qweight.device

    def materialize(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        # `out` is not used: unpacking builds a fresh weight anyway, and copying it over would add a pass.
        return dequantize_packed(self.qweight, self.qzeros, self.scales, self.g_idx, self.bits,
                                 dtype or self.weight_dtype)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) / .half() / .bfloat16() would convert the fp16 scales too: keep them as stored
        # and follow only the device.
        scales = self.scales
        result = super()._apply(fn, recurse)
        if self.scales.dtype != torch.float16:
            self.scales = scales.to(self.scales.device)
        return result

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"bits={self.bits}, group_size={self.group_size}")


def gptq_settings_of(directory: Path) -> GptqSettings | None:
    """The GPTQ settings of a model directory's config.json, or None when it is not a GPTQ model."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return read_quantization_config(config, str(Path(directory) / "config.json"))


def install_gptq_layers(model: nn.Module, checkpoint_keys: set[str], settings: GptqSettings,
                        dtype: torch.dtype, where: str) -> set[str]:
    """Swap each linear layer that the checkpoint stores as GPTQ tensors for an empty `GptqLinear` of
    the same shape (the loader then fills its buffers); returns the keys to read as stored (no dtype
    conversion). Called on a model built on the meta device, before any weight is read."""
    swapped, as_stored = 0, set()
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or f"{name}.qweight" not in checkpoint_keys:
            continue
        problem = check_packable(name, module.in_features, module.out_features)
        if problem:
            raise MudpuppyError(f"{where}: {problem}")
        layer = GptqLinear(module.in_features, module.out_features, settings.bits, settings.group_size,
                           f"{name}.bias" in checkpoint_keys, dtype, device="meta")
        model.set_submodule(name, layer)
        as_stored |= {f"{name}.{buffer}" for buffer in BUFFERS}
        swapped += 1
    if not swapped:
        raise MudpuppyError(f"{where}: config.json says GPTQ (quantization_config) but the checkpoint holds no "
                            "qweight tensors")
    return as_stored
