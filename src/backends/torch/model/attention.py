"""Which attention a model runs, and the masks that keep packed examples apart.

Attention: SDPA where transformers supports it for the model class
(`_supports_sdpa`), else eager. transformers refuses SDPA outright for some
(Gemma 2: attention-logit soft-capping; gpt-oss: attention sinks), and the
kernels it offers for sinks come from the hub, which a run must not need.

Packing: a packed row holds several examples end to end. Restarting position
ids at each example is not enough: transformers (5.x, sdpa and eager) still
lets a token attend to every earlier token of the row, measured at ~0.5 logit
error. An explicit 4D block-diagonal causal mask isolates them exactly: token
q may attend to token k only when both belong to the same segment and k <= q.
Padding is segment 0 and attends only to earlier padding, so no attention row
is empty (an all-blocked row would turn into NaNs in the softmax).

transformers uses a 4D mask as given, for every layer: a model with
sliding-window layers would lose its window. So the mask follows what the
decoder's own forward builds (read from its source): one mask for all layers
(`create_causal_mask`, or `create_sliding_window_causal_mask` when
`config.sliding_window` is set, as Mistral does), or, where the forward takes a
dict keyed by `config.layer_types` (Gemma 2/3, Qwen2/3, gpt-oss, Cohere 2), one
mask per layer type, the sliding one also limited to the window
(k > q - sliding_window, transformers' rule). A decoder that builds any other
mask (chunked attention, recurrent/SSM layers) cannot be packed exactly and is
refused by name.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ....errors import MudpuppyError

# Implementations that take a 4D mask as given. flash-attention takes none,
# and flex-attention wants a BlockMask: both are refused rather than run unmasked.
MASKABLE = ("sdpa", "eager")
# The mask builders of transformers' masking_utils whose 4D result a block-diagonal mask can replace.
KNOWN_MASKS = {"create_causal_mask", "create_sliding_window_causal_mask"}
LAYER_KINDS = ("full_attention", "sliding_attention")


def choose_attention(auto_class: str, config) -> str | None:
    """"sdpa" where transformers supports it for the class `auto_class` builds from `config`, else "eager";
    None for a class transformers' auto mapping does not know (remote code): transformers then picks
    itself, SDPA where the class supports it, eager otherwise."""
    import transformers

    try:
        cls = getattr(transformers, auto_class)._model_mapping[type(config)]
    except (AttributeError, KeyError, ValueError):
        return None
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def packing_mask(model, segment_ids: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask of a packed batch for `model` (a transformers causal LM): one [B, 1, T, T] mask,
    or a dict of them per layer type. Raises MudpuppyError naming the family when it cannot be exact."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if decoder is model:      # some classes answer themselves (Llama 4): the decoder is their `model`
        decoder = getattr(model, "model", model)
    config = decoder.config
    impl = getattr(config, "_attn_implementation", None) or "eager"
    family = getattr(config, "model_type", type(model).__name__)
    dict_ok, creators = decoder_masks(type(decoder).forward)
    unknown = sorted(creators - KNOWN_MASKS) or ([] if creators else ["no mask of transformers' masking_utils"])
    if unknown:
        raise MudpuppyError(f"data.packing: {family} builds its attention with {', '.join(unknown)} (chunked or "
                            "recurrent layers), which a block-diagonal mask cannot keep exact; set data.packing: "
                            "false (data.tokens_per_batch keeps padding low)")
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or ())
    if dict_ok and kinds:
        odd = sorted(kinds - set(LAYER_KINDS))
        if odd:
            raise MudpuppyError(f"data.packing: {family} has {', '.join(odd)} layers, which a block-diagonal mask "
                                "cannot keep exact; set data.packing: false")
        return {kind: packed_attention_mask(segment_ids, impl, model.dtype,
                                            window if kind == "sliding_attention" else None)
                for kind in sorted(kinds)}
    if "sliding_attention" in kinds and "create_sliding_window_causal_mask" not in creators:
        raise MudpuppyError(f"data.packing: {family} has sliding-window layers but takes one mask for all; "
                            "set data.packing: false")
    slide = window if "create_sliding_window_causal_mask" in creators else None
    return packed_attention_mask(segment_ids, impl, model.dtype, slide)


@functools.lru_cache(maxsize=64)
def decoder_masks(forward) -> tuple[bool, frozenset[str]]:
    """(whether the decoder's forward takes a dict of masks per layer type, the masking_utils builders it calls)."""
    try:
        source = inspect.getsource(inspect.unwrap(forward))
    except (OSError, TypeError):
        return False, frozenset()
    takes_dict = re.search(r"isinstance\((causal_mask_mapping := )?attention_mask, dict\)", source) is not None
    return takes_dict, frozenset(re.findall(r"\b(create_\w*mask)\b", source))


def packed_attention_mask(segment_ids: torch.Tensor, attn_implementation: str, dtype: torch.dtype,
                          window: int | None = None) -> torch.Tensor:
    """[B, 1, T, T] mask: bool (True = attend) for sdpa, additive float (0 or dtype-min) for eager; with
    `window`, a query also sees only the keys less than `window` positions back."""
    if attn_implementation not in MASKABLE:
        raise MudpuppyError(
            f"data.packing needs an attention implementation that accepts a 4D mask ({', '.join(MASKABLE)}); "
            f"this model uses {attn_implementation!r}. Turn packing off, or load the model with sdpa")
    width = segment_ids.shape[-1]
    causal = torch.ones(width, width, dtype=torch.bool, device=segment_ids.device).tril()
    if window is not None:
        causal = causal & ~torch.ones_like(causal).tril(-window)     # k > q - window
    allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal
    allowed = allowed[:, None, :, :]
    if attn_implementation == "sdpa":
        return allowed
    blocked = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=segment_ids.device)
    return blocked.masked_fill(allowed, 0.0)


# ---------------------------------------------------------------- which SDPA kernel

# Short rows attend through SDPA's math kernel on a CPU: for the quickstart's batches (8 x ~50 tokens,
# SmolLM2's 9 heads) a forward and backward of the fused (flash) CPU kernel took 5.3 ms per layer, the
# math kernel 1.8 ms (bf16, AMX Xeon, 2 threads; 64 tokens 5.5 vs 2.8 ms, 128: 11.7 vs 8.4, 256: 16.8
# vs 29.0). The math kernel keeps the [batch, heads, T, T] probabilities for the backward, so it is
# taken only while they stay small (the element budget below: 4 MB a layer in fp32).
MATH_ATTENTION_MAX_WIDTH = 128
MATH_ATTENTION_MAX_SCORES = 1 << 20


def attention_kernels(device: torch.device, batch: int, width: int, heads: int):
    """The SDPA kernels for a micro-batch of `batch` rows of `width` tokens: a context to hold
    around its forward *and* backward (checkpointing recomputes the forward inside the backward,
    and must choose the kernel the forward chose). Both kernels give the same values to the
    rounding of the output (checked in tests/backends/test_torch_speed_paths.py)."""
    scores = batch * heads * width * width
    if device.type != "cpu" or width > MATH_ATTENTION_MAX_WIDTH or scores > MATH_ATTENTION_MAX_SCORES:
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.MATH])
