"""Which type each tensor of a K-quant GGUF gets: llama.cpp's `llama_tensor_get_type`.

A Q4_K_M file is not all Q4_K: llama-quantize gives half the attn_v and ffn_down matrices Q6_K,
the output matrix Q6_K, and falls back to 32-value block types where a row is not a multiple of 256.
This is that choice, transcribed from llama.cpp's src/llama-quant.cpp (the copy vendored in the
llama-cpp-python 0.3.36 sdist; line numbers below are that file's) for the nine K-quant file types
and the families mudpuppy writes (no Falcon, no IQ or MXFP4 file types):

    tensor_allows_quantization      lines 287-383   2-D/3-D `*weight`, no norms, no MoE routers
    tensor_get_category             lines 119-152   output, token_embd, attn_v/qkv/kv_b, attn_k, ... by name
    tensor_type_fallback            lines 390-443   Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0,
                                                    then F16 if the row is not a multiple of 32 either
    llama_tensor_get_type_impl      lines 446-714   the per-file-type rules (attn_v and ffn_down by layer)
    llama_ftype_get_default_type    lines 897-907   Q4_K_M -> Q4_K, ...
    init_quantize_state_counters    lines 927-941   n_attention_wv, tied embeddings = no output.weight

Checked (2026-11-27) against llama.cpp's master as indexed then (commit 007dbbf, after the tensor_category
refactor): the same rules and fallbacks for these file types. Older llama.cpp (e.g. 8784689, before that
refactor) sent Q2_K and Q3_K rows that are not a multiple of 256 to IQ4_NL, not Q4_0; mudpuppy writes no
IQ4_NL and follows the vendored version it is byte-tested against.

llama-quantize visits tensors sorted by layer, then by name (llama-model-loader.h:54-65,
weight_name_comparer); the attn_v counter advances in that order, so this does too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# --quant -> (default type, gguf.LlamaFileType member)                       llama-quant.cpp:897-907
FILE_TYPES = {
    "q2_k": ("Q2_K", "MOSTLY_Q2_K"), "q3_k_s": ("Q3_K", "MOSTLY_Q3_K_S"), "q3_k_m": ("Q3_K", "MOSTLY_Q3_K_M"),
    "q3_k_l": ("Q3_K", "MOSTLY_Q3_K_L"), "q4_k_s": ("Q4_K", "MOSTLY_Q4_K_S"), "q4_k_m": ("Q4_K", "MOSTLY_Q4_K_M"),
    "q5_k_s": ("Q5_K", "MOSTLY_Q5_K_S"), "q5_k_m": ("Q5_K", "MOSTLY_Q5_K_M"), "q6_k": ("Q6_K", "MOSTLY_Q6_K"),
}
# the file types whose tensors take these rules: the K-quants, and q4_0, whose output matrix llama-quantize
# makes Q6_K (Q8_0 where its rows are not a multiple of 256) and whose 8-expert attn_v/attn_k Q8_0
RECIPES = {**FILE_TYPES, "q4_0": ("Q4_0", "MOSTLY_Q4_0")}
BLOCK_SIZE = {"Q2_K": 256, "Q3_K": 256, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256,
              "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "F16": 1, "F32": 1}
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}   # :409-415
# name fragments llama.cpp never quantizes (the ones that can occur in the families written here)
NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "altup", "laurel", "per_layer_model_proj",
                 "ssm_conv1d", "attn_rel_b.weight", ".position_embd")


@dataclass(frozen=True)
class ModelInfo:
    """What the rules read from the model (llama_hparams and llm_type)."""
    arch: str                   # llama.cpp arch name: "llama", "qwen2", ...
    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int = 0

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        """LLM_TYPE_70B, the only model size the rules read (models/llama.cpp:28, models/qwen2.cpp:14)."""
        if self.n_layer != 80:
            return False
        return self.arch == "qwen2" or (self.arch == "llama" and self.n_head != self.n_head_kv)


def category(name: str) -> str:
    """tensor_get_category (llama-quant.cpp:119-152)."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for fragment, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"),
                          ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                          ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                          ("ffn_down", "ffn_down")):
        if fragment in name:
            return cat
    return "other"


def allows_quantization(name: str, n_dims: int) -> bool:
    """tensor_allows_quantization (llama-quant.cpp:287-383), for the tensors these families hold."""
    return n_dims >= 2 and name.endswith("weight") and not any(f in name for f in NOT_QUANTIZED)


def fallback(qtype: str, ncols: int) -> str:
    """tensor_type_fallback (llama-quant.cpp:390-443): a type whose blocks fit the row."""
    if ncols % BLOCK_SIZE[qtype] == 0:
        return qtype
    qtype = FALLBACK.get(qtype, qtype)
    return qtype if ncols % BLOCK_SIZE[qtype] == 0 else "F16"


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp:452-454: the first and last eighth of the layers, and every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


class Recipe:
    """The state llama-quantize carries across tensors (quantize_state_impl's counters)."""

    def __init__(self, ftype: str, model: ModelInfo, names: list[str]):
        self.ftype, self.model = ftype, model
        self.default = RECIPES[ftype][0]
        cats = [category(n) for n in names]
        self.n_attention_wv = sum(c in ("attn_v", "attn_qkv", "attn_kv_b") for c in cats)
        self.tied = "output" not in cats
        self.i_attention_wv = self.i_ffn_down = 0

    def layer(self, counter: int, name: str) -> int:
        """layer_info (:456-470): MoE models read the layer from the name, others count."""
        if self.model.n_expert > 1:
            found = re.match(r"blk\.(\d+)\.", name)
            if not found:
                raise ValueError(f"Failed to determine layer for tensor {name}")
            return int(found[1])
        return counter

    def choose(self, name: str, ncols: int) -> str:
        """llama_tensor_get_type (:717-772) for one quantizable tensor, then its fallback."""
        return fallback(self._rules(name, ncols), ncols)

    def _rules(self, name: str, ncols: int) -> str:
        f, m, cat, new = self.ftype, self.model, category(name), self.default
        if cat == "output" or (self.tied and cat == "token_embd"):                     # :490-510
            return "Q8_0" if ncols % BLOCK_SIZE[new] else "Q6_K"
        if cat == "token_embd":
            return new
        if cat in ("attn_v", "attn_qkv", "attn_kv_b"):                                  # :567-604
            i = self.i_attention_wv
            if f == "q2_k":
                new = "Q4_K" if m.n_gqa >= 4 else "Q3_K"
            elif f == "q3_k_m":
                new = "Q5_K" if i < 2 else "Q4_K"
            elif f == "q3_k_l":
                new = "Q5_K"
            elif f in ("q4_k_m", "q5_k_m") and use_more_bits(i, self.n_attention_wv):
                new = "Q6_K"
            elif f == "q4_k_s" and i < 4:
                new = "Q5_K"
            if m.is_70b and new in ("Q3_K", "Q4_K"):
                new = "Q5_K"
            if m.n_expert == 8:
                new = "Q8_0"
            self.i_attention_wv += 1
            return new
        if cat == "attn_k":                                                              # :605-617
            return "Q8_0" if m.n_expert == 8 else new
        if cat == "ffn_down":                                                            # :624-668
            return self._ffn_down(name, new)
        if cat == "attn_output":                                                         # :669-686
            if m.n_expert == 8:
                return "Q5_K" if f in ("q2_k", "q3_k_s", "q3_k_m", "q4_k_s", "q4_k_m") else new
            return {"q2_k": "Q3_K", "q3_k_m": "Q4_K", "q3_k_l": "Q5_K"}.get(f, new)
        # the ATTENTION_QKV branch (:689-695) is never reached: category_is_attn_v takes attn_qkv first
        return new

    def _ffn_down(self, name: str, new: str) -> str:
        f = self.ftype
        i, n = self.layer(self.i_ffn_down, name), self.model.n_layer
        if f == "q2_k":
            new = "Q3_K"
        elif f == "q3_k_m":
            new = "Q5_K" if i < n // 16 else "Q4_K"          # non-Falcon: use_more_bits or not, Q4_K
        elif f == "q3_k_l":
            new = "Q5_K"
        elif f in ("q4_k_m", "q5_k_m"):
            new = "Q6_K" if use_more_bits(i, n) else new
        elif f == "q4_k_s" and i < n // 8:
            new = "Q5_K"
        self.i_ffn_down += 1
        return new


def sort_key(name: str) -> tuple[int, str]:
    """weight_name_comparer (llama-model-loader.h:54-65): layer (-1 outside blocks), then the name."""
    found = re.match(r"blk\.(\d+)\.", name)
    return (int(found[1]) if found else -1, name)


def tensor_types(tensors: dict[str, tuple[int, ...]], ftype: str, model: ModelInfo) -> dict[str, str | None]:
    """GGUF tensor name -> ggml type name for the file type `ftype` (q4_k_m, ...), None where llama.cpp
    keeps the tensor's own type. `tensors` maps names to shapes in numpy order ([E,] rows, cols)."""
    if ftype not in RECIPES:
        raise ValueError(f"{ftype}: not a file type llama-quantize's rules apply to ({', '.join(RECIPES)})")
    names = sorted(tensors, key=sort_key)
    recipe = Recipe(ftype, model, names)
    out: dict[str, str | None] = {}
    for name in names:
        shape = tensors[name]
        out[name] = recipe.choose(name, shape[-1]) if allows_quantization(name, len(shape)) else None
    return out
