"""What differs per model family in a GGUF file, as one table.

llama.cpp's convert_hf_to_gguf.py has a class per architecture; almost all of what those classes
do is data: which llama.cpp architecture a Hugging Face one becomes, which of three or four
transforms its tensors need, and which metadata keys its loader (src/models/<arch>.cpp,
load_arch_hparams) reads. Tensor names are never written here: gguf's TensorNameMap maps every
Hugging Face name (gguf/tensor_mapping.py), and gguf's MODEL_TENSORS says what each arch holds.

    transform       what and why
    permute_qk      llama.cpp's LLAMA, GRANITE and SMOLLM3 graphs rotate interleaved pairs; Hugging
                    Face rotates half-split heads: q/k rows are reordered (convert's LlamaModel.permute).
                    Qwen, Gemma, Phi-3, OLMo 2 and gpt-oss rotate as Hugging Face does ("neox"); GLM-4
                    and Cohere rotate interleaved pairs in Hugging Face too, so they are written as is.
    norm_shift      Gemma's RMSNorm scales by (1 + w) and stores w; llama.cpp multiplies by the
                    stored tensor, so it is written as w + 1 (every *norm.weight, q/k norms too).
    experts         transformers 5 holds experts fused in 3-D tensors and saves them either so or
                    per expert; GGUF wants ffn_{gate,up,down}_exps stacked [expert, out, in]:
                      "halves"       gate_up_proj [E, 2F, H]: gate rows first, then up (Qwen3-MoE, Mixtral)
                      "interleaved"  gate_up_proj [E, H, 2F]: (in, out), gate and up alternating
                                     columns, with biases (gpt-oss)
    output          "optional": no output.weight when the head is tied (llama.cpp reuses token_embd);
                    "required": the loader insists on output.weight: a tied head is written twice;
                    "tied": the graph always reuses token_embd (Gemma 2, Cohere): an untied head is
                    refused.
    fused MLPs      GLM-4's gate_up_proj [2F, H] (gate rows, then up) is llama.cpp's ffn_up as it is:
                    its glm4 graph splits it with a SwiGLU over the halves, gate first.

Each `check` returns what the llama.cpp graph for that arch would compute differently, so that
such a model is refused before any weight is read, rather than exported wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..gguf_check import value_problem

Config = dict


# --------------------------------------------------------------------------- config readers

def rope_parameters(config: Config, layer_type: str = "full_attention") -> dict:
    """rope_theta and scaling for one layer type, from transformers 5's rope_parameters (flat or
    per layer type) or the older top-level keys."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "full_attention" in params or "sliding_attention" in params:
        params = dict(params.get(layer_type) or params.get("full_attention") or {})
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or params.get("type") or "default"
    return {**params, "type": kind, "theta": float(theta)}


def head_dim(config: Config) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def partial_rotary_factor(config: Config, default: float = 1.0) -> float:
    return float(rope_parameters(config).get("partial_rotary_factor", config.get("partial_rotary_factor", default)))


def n_experts(config: Config) -> int:
    return int(config.get("num_local_experts") or config.get("num_experts") or 0)


def layer_types(config: Config) -> list[str]:
    return list(config.get("layer_types") or ["full_attention"] * int(config["num_hidden_layers"]))


# --------------------------------------------------------------------------- metadata writers
# Each takes (gguf.GGUFWriter, config); the keys are gguf's (gguf.Keys), through the writer.

def rope_dims(w, c: Config) -> None:
    w.add_rope_dimension_count(head_dim(c))


def experts(w, c: Config) -> None:
    w.add_expert_count(n_experts(c))
    w.add_expert_used_count(int(c["num_experts_per_tok"]))


def moe_feed_forward(w, c: Config) -> None:
    w.add_expert_feed_forward_length(int(c["moe_intermediate_size"]))


def expert_feed_forward(w, c: Config) -> None:
    w.add_expert_feed_forward_length(int(c["intermediate_size"]))


def sliding_window(w, c: Config) -> None:
    """The window and which layers use it, as the per-layer array llama.cpp's load_swa_pattern reads
    first (exact for any layer_types, not the arch's default period)."""
    kinds = layer_types(c)
    if "sliding_attention" not in kinds or not c.get("sliding_window"):
        return
    w.add_sliding_window(int(c["sliding_window"]))
    w.add_sliding_window_pattern([k == "sliding_attention" for k in kinds])
    params = c.get("rope_parameters") or {}
    if "sliding_attention" in params:
        w.add_rope_freq_base_swa(rope_parameters(c, "sliding_attention")["theta"])


def softcapping(w, c: Config) -> None:
    if c.get("attn_logit_softcapping"):
        w.add_attn_logit_softcapping(float(c["attn_logit_softcapping"]))
    if c.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(c["final_logit_softcapping"]))


def granite_scales(w, c: Config) -> None:
    """Granite's multipliers under llama.cpp's *_scale names (GraniteModel.set_gguf_parameters)."""
    w.add_attention_scale(float(c.get("attention_multiplier", 1.0)))
    w.add_embedding_scale(float(c.get("embedding_multiplier", 1.0)))
    w.add_residual_scale(float(c.get("residual_multiplier", 1.0)))
    w.add_logit_scale(float(c.get("logits_scaling", 1.0)))


def phi3_rope(w, c: Config) -> None:
    """Phi3MiniModel.set_gguf_parameters: the rotated width, the original context, and the window key
    (which llama.cpp reads and then ignores: see phi3_window)."""
    rope = rope_parameters(c)
    dims = int(float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))) * c["hidden_size"])
    w.add_rope_dimension_count(dims // c["num_attention_heads"])
    w.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings")
                                        or c.get("original_max_position_embeddings") or c["max_position_embeddings"]))
    w.add_sliding_window(int(c.get("sliding_window") or 0))


def glm4_rope(w, c: Config) -> None:
    """Glm4Model.set_gguf_parameters: only the first partial_rotary_factor of each head rotates (0.5 when the
    config does not say: Glm4Config's own default)."""
    w.add_rope_dimension_count(int(head_dim(c) * partial_rotary_factor(c, default=0.5)))


def cohere_head(w, c: Config) -> None:
    """CommandR2Model.set_gguf_parameters: the logits' multiplier, and no rope scaling said explicitly."""
    import gguf

    w.add_logit_scale(float(c.get("logit_scale", 0.0625)))
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)


# --------------------------------------------------------------------------- checks
# Each takes the config and returns a problem (what llama.cpp would do differently) or None.

def gemma_attention_scale(c: Config) -> str | None:
    """llama.cpp scales queries by 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 27B layer counts);
    Hugging Face by query_pre_attn_scalar**-0.5."""
    scalar = c.get("query_pre_attn_scalar")
    allowed = {head_dim(c)}
    if c["num_hidden_layers"] in (46, 62):
        allowed = {c["hidden_size"] // c["num_attention_heads"]}
    if scalar is not None and int(scalar) not in allowed:
        return (f"query_pre_attn_scalar {scalar} (llama.cpp scales attention by 1/sqrt({min(allowed)}) for this "
                "shape)")
    return None


def gemma2_softcaps(c: Config) -> str | None:
    if not c.get("attn_logit_softcapping"):
        return "no attn_logit_softcapping (llama.cpp's gemma2 graph always soft-caps attention, by 50 by default)"
    return None


def gemma3_sliding_rope(c: Config) -> str | None:
    if c.get("attn_logit_softcapping"):
        return "attn_logit_softcapping (llama.cpp's gemma3 graph has none)"
    if c.get("use_bidirectional_attention"):
        return "use_bidirectional_attention: true"
    sliding = rope_parameters(c, "sliding_attention")
    if "sliding_attention" in layer_types(c) and sliding["type"] != "default":
        return (f"rope scaling {sliding['type']!r} on sliding-window layers (llama.cpp scales only the "
                "full-attention ones)")
    return None


def qwen3_moe_routing(c: Config) -> str | None:
    if not c.get("norm_topk_prob", False):
        return "norm_topk_prob: false (llama.cpp's qwen3moe graph always renormalizes the top-k expert weights)"
    if c.get("mlp_only_layers") or int(c.get("decoder_sparse_step", 1)) != 1:
        return "dense layers between the MoE ones (mlp_only_layers / decoder_sparse_step)"
    if c.get("use_sliding_window"):
        return "use_sliding_window: true"
    return None


def no_sliding_window(c: Config) -> str | None:
    if c.get("use_sliding_window"):
        return "use_sliding_window: true (this llama.cpp arch attends to the whole context)"
    if "sliding_attention" in layer_types(c):
        return "sliding-window layers (this llama.cpp arch attends to the whole context)"
    return None


def window_ignored(c: Config) -> str | None:
    """Mistral and Mixtral set a plain sliding_window that their llama.cpp arch (llama) cannot hold:
    llama.cpp's own converter drops it too, so the export goes on, saying where answers start to differ."""
    window = c.get("sliding_window")
    if window and not c.get("use_sliding_window") and int(window) < int(c.get("max_position_embeddings") or 2**31):
        return (f"llama.cpp runs this model as llama, without its sliding window of {window} tokens: past {window} "
                "tokens of context its attention differs from Hugging Face's (as with llama.cpp's own converter)")
    return None


def gpt_oss_swiglu(c: Config) -> str | None:
    alpha, limit = float(c.get("swiglu_alpha", 1.702)), float(c.get("swiglu_limit", 7.0))
    if not (math.isclose(alpha, 1.702) and math.isclose(limit, 7.0)):
        return f"swiglu_alpha {alpha} / swiglu_limit {limit} (llama.cpp's graph hard-codes 1.702 / 7.0)"
    return None


def granite_head_dim(c: Config) -> str | None:
    if c.get("head_dim") and int(c["head_dim"]) != c["hidden_size"] // c["num_attention_heads"]:
        return f"head_dim {c['head_dim']} (llama.cpp's converter drops Granite's head_dim)"
    return None


def smollm3_no_rope(c: Config) -> str | None:
    """llama.cpp's smollm3 graph skips the rotary embedding on every 4th layer (n_no_rope_layer_step = 4,
    hard-coded); Hugging Face on the layers no_rope_layers marks 0 (by default every no_rope_layer_interval-th)."""
    n = int(c["num_hidden_layers"])
    interval = int(c.get("no_rope_layer_interval") or 4)
    used = [int(bool(x)) for x in (c.get("no_rope_layers") or [(i + 1) % interval != 0 for i in range(n)])]
    llama = [int((i + 1) % 4 != 0) for i in range(n)]
    if used != llama:
        return (f"no_rope_layers {used} (llama.cpp's smollm3 graph uses rotary embeddings exactly on {llama}: "
                "every 4th layer without)")
    return None


def glm4_text_rope(c: Config) -> str | None:
    if "mrope_section" in (c.get("rope_parameters") or {}):
        return ("multimodal rotary sections (mrope_section: convert the vision-language model with llama.cpp's "
                "converter)")
    return None


def cohere_qk_norm(c: Config) -> str | None:
    """llama.cpp's command-r loader reads q/k norms exactly when the model has 64 layers or more (Command R+)."""
    n = int(c["num_hidden_layers"])
    if c.get("use_qk_norm") and n < 64:
        return f"use_qk_norm: true with {n} layers (llama.cpp's command-r graph has q/k norms only from 64 layers on)"
    if not c.get("use_qk_norm") and n >= 64:
        return f"use_qk_norm: false with {n} layers (llama.cpp's command-r graph requires q/k norms from 64 layers on)"
    return None


# --------------------------------------------------------------------------- the table

@dataclass(frozen=True)
class Family:
    arch: str                                     # gguf.MODEL_ARCH member name
    permute_qk: bool = False
    norm_shift: float = 0.0
    experts: str | None = None                    # "halves" | "interleaved" (see the module docstring)
    output: str = "optional"                      # "optional" | "required" | "tied"
    act: str | None = "silu"                      # the MLP activation the llama.cpp graph hard-codes
    attention_bias: bool = False                  # q/k/v (and o) biases exist in the llama.cpp graph
    rope: tuple[str, ...] = ("default",)          # rope_type values written exactly
    keys: tuple[Callable, ...] = ()               # metadata writers beyond the common ones
    checks: tuple[Callable, ...] = ()             # config -> problem | None
    notes: tuple[str, ...] = ()                   # what differs, said at export and in export.json
    note_checks: tuple[Callable, ...] = ()        # config -> what differs for this config | None


LLAMA = Family("LLAMA", permute_qk=True, rope=("default", "linear", "llama3"), keys=(rope_dims,),
               checks=(no_sliding_window,), note_checks=(window_ignored,))
GEMMA_ACT = "gelu_pytorch_tanh"

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,                  # llama.cpp runs Mistral as llama
    "Qwen2ForCausalLM": Family("QWEN2", attention_bias=True, rope=("default", "linear", "yarn"),
                               checks=(no_sliding_window,)),
    "Qwen3ForCausalLM": Family("QWEN3", rope=("default", "linear", "yarn"), checks=(no_sliding_window,)),
    "Qwen3MoeForCausalLM": Family("QWEN3MOE", experts="halves", rope=("default", "linear", "yarn"),
                                  keys=(experts, moe_feed_forward), checks=(qwen3_moe_routing,)),
    "MixtralForCausalLM": Family("LLAMA", permute_qk=True, experts="halves", rope=("default", "linear"),
                                 keys=(rope_dims, experts), checks=(no_sliding_window,),
                                 note_checks=(window_ignored,)),
    "Gemma2ForCausalLM": Family("GEMMA2", norm_shift=1.0, output="tied", act=GEMMA_ACT,
                                keys=(softcapping, sliding_window), checks=(gemma_attention_scale, gemma2_softcaps)),
    "Gemma3ForCausalLM": Family("GEMMA3", norm_shift=1.0, act=GEMMA_ACT, rope=("default", "linear"),
                                keys=(softcapping, sliding_window),
                                checks=(gemma_attention_scale, gemma3_sliding_rope)),
    "Phi3ForCausalLM": Family("PHI3", rope=("default", "longrope"), keys=(phi3_rope,),
                              notes=("llama.cpp disables Phi-3's sliding window: past sliding_window tokens "
                                     "its attention differs from Hugging Face's (as with llama.cpp's own "
                                     "converter)",)),
    "GraniteForCausalLM": Family("GRANITE", permute_qk=True, rope=("default", "linear"),
                                 keys=(rope_dims, granite_scales), checks=(granite_head_dim, no_sliding_window)),
    "Olmo2ForCausalLM": Family("OLMO2", output="required", keys=(sliding_window,)),
    "SmolLM3ForCausalLM": Family("SMOLLM3", permute_qk=True, rope=("default", "linear", "yarn"),
                                 keys=(rope_dims,), checks=(smollm3_no_rope, no_sliding_window)),
    "Glm4ForCausalLM": Family("GLM4", attention_bias=True, rope=("default", "linear"), keys=(glm4_rope,),
                              checks=(glm4_text_rope,)),
    "CohereForCausalLM": Family("COMMAND_R", output="tied", keys=(cohere_head,), checks=(cohere_qk_norm,)),
    "GptOssForCausalLM": Family("GPT_OSS", experts="interleaved", output="required", act=None,
                                attention_bias=True, rope=("yarn",), keys=(experts, expert_feed_forward,
                                                                           sliding_window),
                                checks=(gpt_oss_swiglu,),
                                notes=("llama.cpp's YaRN rounds the correction range outward (transformers' "
                                       "truncate: true); gpt-oss's config says truncate: false, so rotary "
                                       "angles differ slightly in the blended band, as with llama.cpp's own "
                                       "converter",)),
}

def notes_of(family: Family, config: Config) -> list[str]:
    """What the GGUF computes differently from the source model, exported anyway (as llama.cpp's converter
    does) and said: at export and in export.json."""
    return [*family.notes, *filter(None, (check(config) for check in family.note_checks))]


def problems_of(family: Family, config: Config) -> list[str]:
    """Everything in `config` this family's llama.cpp graph would compute differently."""
    problems = []
    if config.get("mlp_bias"):
        problems.append("mlp_bias: true")
    if config.get("attention_bias") and not family.attention_bias:
        problems.append("attention_bias: true")
    if family.output == "tied" and not config.get("tie_word_embeddings", True):
        problems.append(f"an output head not tied to the embedding (llama.cpp's {family.arch.lower()} graph "
                        "always reuses token_embd)")
    act = config.get("hidden_activation") or config.get("hidden_act")
    if family.act and act and act != family.act:
        problems.append(f"activation {act} (llama.cpp's {family.arch.lower()} graph uses {family.act})")
    rope = rope_parameters(config)
    if rope["type"] not in family.rope:
        problems.append(f"rope scaling {rope['type']!r} (written for this family: {', '.join(family.rope)})")
    for check in family.checks:
        problem = check(config)
        if problem:
            problems.append(problem)
    return problems


# --------------------------------------------------------------------------- value ranges

# config.json keys that llama.cpp reads as uint32 or float32 hyperparameters. A value past its type
# (max_position_embeddings 2^62) used to fail deep in gguf's writer as struct.error, after the vocabulary
# had been built to vocab_size; it is refused first, naming the key.
UINT32_KEYS = ("max_position_embeddings", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "vocab_size", "head_dim", "sliding_window",
               "num_experts_per_tok", "num_local_experts", "num_experts", "moe_intermediate_size")
FLOAT32_KEYS = ("rms_norm_eps", "layer_norm_eps", "rope_theta")


def range_problems(config: Config) -> list[str]:
    """The config.json values a GGUF's metadata types cannot hold, converted as the writer converts them."""
    problems = []
    for keys, convert, type_name in ((UINT32_KEYS, int, "uint32"), (FLOAT32_KEYS, float, "float32")):
        for key in keys:
            if config.get(key) is None:
                continue
            try:
                problem = value_problem(convert(config[key]), type_name)
            except (TypeError, ValueError, OverflowError):
                problem = f"{config[key]!r:.60} is not a number"
            if problem:
                problems.append(f"{key}: {problem}")
    return problems


def written_problems(writer) -> list[str]:
    """Every metadata value held by a gguf.GGUFWriter that its GGUF type cannot store: checked before the
    header is written, so nothing fails half-way through the file."""
    import gguf

    problems = []
    for key, item in writer.kv_data[0].items():
        if item.type != gguf.GGUFValueType.ARRAY:
            problem = value_problem(item.value, item.type.name.lower())
        else:
            types = (item.sub_type or gguf.GGUFValueType.get_type(v) for v in item.value)
            problem = next(filter(None, (value_problem(v, t.name.lower()) for v, t in zip(item.value, types))), None)
        if problem:
            problems.append(f"{key}: {problem}")
    return problems
