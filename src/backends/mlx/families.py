"""What each model family needs between a transformers 5 directory and mlx-lm (0.32), and what is refused.

mlx-lm builds a model from config.json and the safetensors as transformers 4 wrote
them. transformers 5 moved some keys and fused some tensors, and a few mlx-lm
models leave out part of what transformers computes. Each difference found is
one small entry here, applied in three places: loading on the MLX backend (the
config and weights in memory, the user's directory untouched), `mudpuppy export
--format mlx` (the files mlx_lm.convert reads) and the refusal check that runs
before any weight loads.

- config keys (all families): rope_theta at the top level (mlx-lm falls back to
  10000 without it); Qwen3-MoE's `num_local_experts` as `num_experts`; GLM-4's
  `partial_rotary_factor` out of `rope_parameters`; Gemma 3's per-layer-type
  rope bases as `rope_theta` / `rope_local_base_freq` and its `layer_types` as
  mlx-lm's `sliding_window_pattern`.
- weights: gpt-oss experts as transformers stores them (`gate_up_proj` [E, in,
  2*out] interleaved, `down_proj` [E, in, out]) into mlx-lm's per-projection
  SwitchLinear weights [E, out, in]; mlx-lm itself reads only OpenAI's MXFP4 layout.
- sliding windows mlx-lm leaves out (Gemma 2, Mistral, Mixtral, Phi-3, Qwen2/3,
  Qwen3-MoE ignore `sliding_window` there): the MLX backend restores them layer
  by layer (`restore_windows`); an mlx_lm.load of an export cannot, which the
  export reports (exact up to the window's length).
- YaRN rope: mlx-lm's YarnRoPE always rounds its correction range outward (transformers'
  `truncate: true`) and never reads `attention_factor`; gpt-oss says `truncate: false` (as
  OpenAI's reference computes it), which moved two of its frequencies by 14% and 100%. The MLX
  backend gives each YaRN rope transformers' frequencies and factor (`exact_yarn`).

Nothing here imports mlx at module level: export preflight reads it without mlx.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from ...errors import MudpuppyError

# model_type -> the family's name in messages (mlx-lm module names differ for a few).
NAMES = {
    "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE",
    "mixtral": "Mixtral", "gemma2": "Gemma 2", "gemma3_text": "Gemma 3 (text)", "phi3": "Phi-3",
    "granite": "Granite", "olmo2": "OLMo 2", "gpt_oss": "gpt-oss", "smollm3": "SmolLM3", "glm4": "GLM-4",
    "cohere": "Cohere", "cohere2": "Cohere 2",
}
# Families whose mlx-lm model always has its own lm_head: a tied checkpoint gets the embedding as its head.
UNTIED_ONLY = {"glm4", "gpt_oss"}
# Families whose mlx-lm model ignores config.sliding_window while transformers applies it.
WINDOWLESS = {"gemma2", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe"}
TORCH_INSTEAD = "use a torch backend (cpu, cuda, rocm) for this model"


def family_name(config: dict) -> str:
    model_type = str(config.get("model_type", "?"))
    return NAMES.get(model_type, model_type)


def mlx_lm_module(config: dict) -> str:
    """The mlx_lm.models module mlx-lm would build this config with (its own remapping rules)."""
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = config.get("model_type")
    try:
        from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING
    except ImportError:
        MODEL_ARCHITECTURE_REMAPPING = {}
    for arch in config.get("architectures") or ():
        remapped = MODEL_ARCHITECTURE_REMAPPING.get((model_type, arch))
        if remapped is not None:
            return remapped
    return MODEL_REMAPPING.get(model_type, model_type)


def check_family(config: dict, where: str) -> None:
    """Refuse, naming the family, what mlx-lm lacks or cannot compute as transformers does. Reads only
    config.json (and whether mlx-lm has a module for it): nothing heavy has loaded yet."""
    name = family_name(config)
    if "model_type" not in config:
        raise MudpuppyError(f"{where}: config.json names no model_type, so mlx-lm cannot tell the family; "
                            f"{TORCH_INSTEAD}")
    module = mlx_lm_module(config)
    # A config with its own model_file brings its mlx code (run only with trust_remote_code).
    if "model_file" not in config and importlib.util.find_spec(f"mlx_lm.models.{module}") is None:
        import mlx_lm

        raise MudpuppyError(f"{where}: the {name} family (model_type {config['model_type']!r}) is not in the installed "
                            f"mlx-lm {mlx_lm.__version__}, so the mlx backend cannot run it; {TORCH_INSTEAD}")
    problem = UNMATCHED.get(config["model_type"], lambda _c: None)(config)
    if problem:
        raise MudpuppyError(f"{where}: {name} on MLX: {problem}; {TORCH_INSTEAD}")


def gemma3_problem(config: dict) -> str | None:
    if config.get("final_logit_softcapping") or config.get("attn_logit_softcapping"):
        return ("mlx-lm's gemma3_text applies no logit soft-capping, and this config sets "
                "final_logit_softcapping / attn_logit_softcapping")
    if gemma3_pattern(config) is None:
        return (f"mlx-lm's gemma3_text places a full-attention layer every N layers, ending each group of N, which "
                f"these layer_types do not follow: {config.get('layer_types')}")
    return None


UNMATCHED = {"gemma3_text": gemma3_problem}


def gemma3_pattern(config: dict) -> int | None:
    """mlx-lm's sliding_window_pattern for Gemma 3's layer_types: N where every N-th layer (and only it)
    is full attention; None when there is no such N within the model's layers."""
    types = config.get("layer_types")
    layers = config.get("num_hidden_layers", 0)
    if not types:
        return config.get("sliding_window_pattern", 6) if layers >= config.get("sliding_window_pattern", 6) else None
    for n in range(1, layers + 1):
        if all((t == "full_attention") == (i % n == n - 1) for i, t in enumerate(types)):
            return n
    return None


def mlx_lm_config(config: dict) -> dict:
    """The config keys mlx-lm reads where transformers 5 writes them elsewhere (added, nothing removed)."""
    from ..models import patch_rope_theta

    out = patch_rope_theta(config)
    model_type = config.get("model_type")
    rope = config.get("rope_parameters") or {}
    if model_type == "qwen3_moe" and "num_experts" not in out and "num_local_experts" in out:
        out["num_experts"] = out["num_local_experts"]
    if model_type == "glm4" and "partial_rotary_factor" not in out:
        out["partial_rotary_factor"] = rope.get("partial_rotary_factor", 0.5)
    if model_type == "gemma3_text":
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
        if "rope_theta" in full:
            out["rope_theta"] = full["rope_theta"]
        if "rope_theta" in local:
            out["rope_local_base_freq"] = local["rope_theta"]
        if full.get("rope_type", "default") != "default":
            out["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
        pattern = gemma3_pattern(config)
        if pattern is not None:
            out["sliding_window_pattern"] = pattern
    return out


def config_overrides(config: dict) -> dict:
    """What mlx_lm_config changed or added: mlx-lm's load_model(model_config=...) merges it into config.json."""
    converted = mlx_lm_config(config)
    return {k: v for k, v in converted.items() if k not in config or config[k] != v}


# ---------------------------------------------------------------------------------------- weights


def convert_weights(config: dict, weights: dict) -> dict:
    """transformers 5 tensors -> the names and layouts mlx-lm's model expects, for the families that differ."""
    model_type = config.get("model_type")
    if model_type == "gpt_oss" and any(k.endswith("experts.gate_up_proj") for k in weights):
        weights = gpt_oss_experts(weights)
    if (model_type in UNTIED_ONLY and config.get("tie_word_embeddings") and "lm_head.weight" not in weights
            and "model.embed_tokens.weight" in weights):
        weights = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
    return weights


CONVERTED = {"gpt_oss"} | UNTIED_ONLY     # families whose tensors convert_weights may change


def gpt_oss_experts(weights: dict) -> dict:
    """transformers' fused expert tensors ([E, in, out], gate and up interleaved along out) as mlx-lm's
    SwitchGLU weights ([E, out, in]), the form its sanitize leaves alone."""
    import mlx.core as mx

    out = {}
    for key, value in weights.items():
        if key.endswith("experts.gate_up_proj"):
            stem = key[: -len("gate_up_proj")]
            out[stem + "gate_proj.weight"] = mx.contiguous(value[..., ::2].swapaxes(-1, -2))
            out[stem + "up_proj.weight"] = mx.contiguous(value[..., 1::2].swapaxes(-1, -2))
        elif key.endswith("experts.gate_up_proj_bias"):
            stem = key[: -len("gate_up_proj_bias")]
            out[stem + "gate_proj.bias"] = mx.contiguous(value[..., ::2])
            out[stem + "up_proj.bias"] = mx.contiguous(value[..., 1::2])
        elif key.endswith("experts.down_proj"):
            out[key + ".weight"] = mx.contiguous(value.swapaxes(-1, -2))
        elif key.endswith("experts.down_proj_bias"):
            out[key[: -len("_bias")] + ".bias"] = value
        else:
            out[key] = value
    return out


def model_classes(config: dict):
    """mlx_lm's (Model, ModelArgs) for `config`, the Model's sanitize first converting transformers 5 tensors."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    if config.get("model_type") not in CONVERTED:
        return model_class, args_class

    def sanitize(self, weights):
        weights = convert_weights(config, weights)
        return model_class.sanitize(self, weights) if hasattr(model_class, "sanitize") else weights

    # Same class name: mlx-lm and messages see the family's own Model.
    return type(model_class.__name__, (model_class,), {"sanitize": sanitize}), args_class


def prepare_directory(model_dir: Path) -> list[str]:
    """Rewrite a (scratch) model directory in place so that mlx-lm's own loader reads it as the MLX
    backend does: config keys and converted weights. Returns notes on what an mlx-lm reader still
    computes differently (a window it leaves out)."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    check_family(config, str(model_dir))
    path.write_text(json.dumps(mlx_lm_config(config), indent=2) + "\n", encoding="utf-8")
    if config.get("model_type") in CONVERTED:
        import mlx.core as mx

        # Shard by shard (the tied head's copy lands in the shard holding the embedding).
        for file in sorted(Path(model_dir).glob("model*.safetensors")):
            weights = mx.load(str(file))
            converted = convert_weights(config, weights)
            if converted is not weights:
                mx.save_safetensors(str(file), converted, metadata={"format": "mlx"})
    notes = []
    window = sliding_layers(config)
    if window:
        notes.append(f"mlx-lm's {family_name(config)} leaves out the {window[0]}-token sliding window of "
                     f"{sum(window[1])} of {len(window[1])} layers: mlx_lm.load of this export computes the model "
                     f"exactly on sequences up to {window[0]} tokens (mudpuppy's mlx backend restores the window)")
    moved = yarn_frequencies_rounded(config)
    if moved:
        notes.append(f"mlx-lm's YaRN rope rounds its correction range, which {family_name(config)}'s config "
                     f"(truncate: false) does not: mlx_lm.load of this export computes {moved[0]} of {moved[1]} "
                     "rotary frequencies differently from transformers (mudpuppy's mlx backend computes them "
                     "as transformers does)")
    return notes


def yarn_frequencies_rounded(config: dict) -> tuple[int, int] | None:
    """(frequencies mlx-lm's YarnRoPE gets wrong, all of them) for a YaRN config with `truncate: false`,
    which mlx-lm ignores; None where it computes them as transformers does."""
    import numpy as np

    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type")) != "yarn" or rope.get("truncate", True):
        return None
    dims = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dims = int(dims * rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    exact, _ = yarn_parameters(config, dims)
    rounded, _ = yarn_parameters({**config, "rope_parameters": {**rope, "truncate": True}, "rope_scaling": None},
                                 dims)
    moved = int((np.abs(rounded / exact - 1) > 1e-6).sum())
    return (moved, len(exact)) if moved else None


def check_expert_targets(model, config: dict, wanted) -> None:
    """`all-linear` (or an expert tensor named) on a mixture-of-experts family whose experts mudpuppy cannot
    adapt as PEFT does on torch (experts.py SPLITS lists those it can): its experts hold most of the
    weights, so all-linear would silently train the attention alone; refused by name."""
    from .experts import SPLITS, TARGETS

    if config.get("model_type") in SPLITS or not (wanted == "all-linear" or set(wanted) & set(TARGETS)):
        return
    from mlx.utils import tree_flatten
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    experts = [m for _, m in model.named_modules() if isinstance(m, (SwitchLinear, QuantizedSwitchLinear))]
    if not experts:
        return
    held = sum(v.size for m in experts for _, v in tree_flatten(m.parameters()))
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    raise MudpuppyError(
        f"adapter.target_modules: all-linear on {family_name(config)}: its experts ({held / total:.0%} of the "
        "weights) cannot carry an adapter on the mlx backend (mudpuppy adapts the experts of Qwen3-MoE, Mixtral "
        "and gpt-oss there), so all-linear would train the attention alone; use a torch backend (its LoRA "
        "reaches the experts), or list the modules to adapt (e.g. [q_proj, k_proj, v_proj, o_proj]) to train "
        "those alone on MLX")


# ---------------------------------------------------------------------------------------- YaRN rope


def yarn_parameters(config: dict, dims: int):
    """transformers' _compute_yarn_parameters (modeling_rope_utils.py) for `dims` rotated dimensions, in
    float32: (inv_freq [dims // 2], attention_factor)."""
    import math

    import numpy as np

    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    base = rope.get("rope_theta", config.get("rope_theta"))
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or config["max_position_embeddings"] / original

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = get_mscale(factor, m) / get_mscale(factor, m_all) if m and m_all else get_mscale(factor)

    def correction_dim(rotations):
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.get("beta_fast") or 32), correction_dim(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dims // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    pos_freqs = np.float32(base) ** (np.arange(0, dims, 2, dtype=np.float32) / np.float32(dims))
    extrapolation = 1 - ramp
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def exact_yarn(model, config: dict) -> int:
    """Give every YaRN rope of an mlx-lm model transformers' frequencies and attention factor: mlx-lm's
    YarnRoPE floors/ceils the correction range whatever `truncate` says (gpt-oss: false) and ignores
    `attention_factor`. Returns how many ropes it set."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type")) != "yarn":
        return 0
    import mlx.core as mx
    from mlx_lm.models.rope_utils import YarnRoPE

    ropes = [m for _, m in model.named_modules() if isinstance(m, YarnRoPE)]
    for module in ropes:
        inv_freq, attention_factor = yarn_parameters(config, module.dims)
        module._freqs = mx.array(1 / inv_freq)    # mx.fast.rope's freqs are periods; "_": not a parameter
        module.mscale = attention_factor          # YarnRoPE scales q and k by it, transformers cos and sin
    return len(ropes)


# ---------------------------------------------------------------------------------- sliding windows


def sliding_layers(config: dict) -> tuple[int, list[bool]] | None:
    """(window, which layers use it) where transformers applies a window that mlx-lm leaves out; else None.

    As transformers decides: `layer_types` when the config has them (Gemma 2, Qwen2/3 with
    use_sliding_window), otherwise every layer when `sliding_window` is set (Mistral, Mixtral, Phi-3,
    Qwen3-MoE use create_sliding_window_causal_mask for the whole decoder)."""
    window = config.get("sliding_window")
    if config.get("model_type") not in WINDOWLESS or not window:
        return None
    if config.get("use_sliding_window") is False:
        return None
    layers = config.get("num_hidden_layers", 0)
    types = config.get("layer_types")
    if config.get("model_type") == "gemma2" and not types:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    flags = [t == "sliding_attention" for t in types] if types else [True] * layers
    return (int(window), flags) if any(flags) else None


_WINDOWED: dict[type, type] = {}
# Families whose mlx-lm attention broadcasts a [B, 1, T, T] mask against grouped-query scores
# [B, kv_heads, repeats, T, T], which lines the batch up with the kv heads: their masks get a 5th axis.
GROUPED_SCORES = {"gemma2"}


def restore_windows(model, config: dict) -> int:
    """Give the sliding-window layers of an mlx-lm model that ignores the window their window back, and
    give models that misread a per-row mask (GROUPED_SCORES) one they read right.

    mlx-lm passes one mask to every layer; each such layer's block becomes a subclass (same
    parameters, same name) that narrows the mask it receives to keys within the window (and
    reshapes it) before running as before. The caches of a windowed model become a KVCache
    subclass holding every key, which keeps mudpuppy's batched sampling (plain KVCache only) away
    from it. Returns the window (0: none)."""
    window, flags = sliding_layers(config) or (0, [False] * len(model.layers))
    grouped = config.get("model_type") in GROUPED_SCORES
    for layer, sliding in zip(model.layers, flags):
        if not (sliding or grouped) or type(layer) in _WINDOWED.values():
            continue
        cls = type(layer)
        if cls not in _WINDOWED:
            _WINDOWED[cls] = type(cls.__name__, (cls,), {"__call__": _masked_call})
        layer.__class__ = _WINDOWED[cls]
        layer.sliding_window = window if sliding else 0
        # Only grouped-query attention reshapes its scores to 5 axes; 4-axis scores take the mask as it is.
        layer.grouped_mask = grouped and getattr(getattr(layer, "self_attn", None), "repeats", 1) > 1
    if window and type(model) not in _CACHED.values():
        model.__class__ = _with_window_cache(type(model))
    return window


def _masked_call(self, x, mask=None, cache=None, *args, **kwargs):
    if self.sliding_window:
        mask = window_mask(x, mask, cache, self.sliding_window)
    if self.grouped_mask and not isinstance(mask, str) and mask is not None and mask.ndim == 4:
        mask = mask[:, :, None]         # [B, 1, 1, T, K]: broadcasts over kv heads and their query groups
    return super(type(self), self).__call__(x, mask, cache, *args, **kwargs)


def window_mask(x, mask, cache, window: int):
    """`mask` (None, "causal", a bool or an additive array) narrowed to keys in (q - window, q]. Query
    positions start at what the cache holds already; every key so far is in the cache."""
    import mlx.core as mx

    n = x.shape[1]
    start = 0
    if cache is not None:
        offset = getattr(cache, "offset", 0)
        start = offset if isinstance(offset, int) else int(getattr(cache, "_idx", 0))
    q = mx.arange(start, start + n)[:, None]
    k = mx.arange(start + n)[None]
    allowed = (k <= q) & (k > q - window)
    if mask is None or isinstance(mask, str):
        return allowed
    if mask.dtype == mx.bool_:
        return mask & allowed
    return mx.where(allowed, mask, mx.array(-mx.inf, mask.dtype))


_CACHED: dict[type, type] = {}
_CACHE_CLASS: list[type] = []


def _with_window_cache(cls: type) -> type:
    if cls not in _CACHED:
        def make_cache(self):
            return [window_cache() for _ in self.layers]

        _CACHED[cls] = type(cls.__name__, (cls,), {"make_cache": make_cache})
    return _CACHED[cls]


def window_cache():
    """A KVCache holding every key (the layer's window narrows its mask), of a subclass of its own:
    generation.py batches plain KVCache models only, whose BatchKVCache positions the window does
    not follow. Made on first use (mlx_lm imports transformers, which this module must not do early)."""
    if not _CACHE_CLASS:
        from mlx_lm.models.cache import KVCache

        _CACHE_CLASS.append(type("WindowKVCache", (KVCache,), {}))
    return _CACHE_CLASS[0]()
