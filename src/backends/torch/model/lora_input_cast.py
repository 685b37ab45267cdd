"""LoRA layers' inputs under autocast: left in the compute dtype instead of PEFT's round trip.

PEFT casts a LoRA layer's input to the dtype of its A matrix before the low-rank
product. Under autocast (bf16, or fp16 on GPUs) the A and B matrices are fp32
master weights, so a 16-bit activation is copied to fp32, and autocast copies
it straight back for the matmul: two full-size copies per adapted layer and
per pass, for the same values (a 16-bit float converts to fp32 exactly, so
the round trip returns it unchanged). On SmolLM2-135M (210 adapted layers)
the copies and their gradients were ~8% of a LoRA step on a CPU.

Only plain LoRA layers whose dropout is off skip the cast: a variant (DoRA)
and dropout compute on the input in its own dtype, where fp32 and bf16
differ. Scoped, not permanent: a forward outside autocast (a user's own
call) gets PEFT's cast back, which it needs when the input and the A matrix
differ in dtype.
"""

from __future__ import annotations

import contextlib

from torch import nn

from ..handle import attribute_set


def plain_lora_layers(model: nn.Module) -> list[nn.Module]:
    """LoRA layers of `model` whose input cast can be skipped: no variant, no dropout."""
    from peft.tuners.lora import LoraLayer

    layers = []
    for module in model.modules():
        if not isinstance(module, LoraLayer) or getattr(module, "lora_variant", None):
            continue
        dropouts = getattr(module, "lora_dropout", {})
        if all(isinstance(dropouts[name], nn.Identity) for name in dropouts):
            layers.append(module)
    return layers


@contextlib.contextmanager
def lora_inputs_uncast(layers: list[nn.Module]):
    """Within: `layers` (from `plain_lora_layers`) take their input as it comes. Hold it only
    where autocast computes the low-rank product in the input's dtype anyway."""
    with attribute_set(layers, "cast_input_dtype_enabled", False):
        yield
