"""Merging LoRA/DoRA adapters into their base weights."""

from __future__ import annotations


def merge_adapter(model):
    """The base transformers model with every adapter folded in; a plain model is returned as is."""
    if not hasattr(model, "peft_config"):
        return model
    from ..quantization.linear4bit import dequantize_model

    # A QLoRA base is folded back to plain linears first: the adapter merges into
    # exactly the (dequantized) weights it was trained on.
    dequantize_model(model)
    # safe_merge checks for NaNs in the merged weights before committing them.
    return model.merge_and_unload(safe_merge=True)
