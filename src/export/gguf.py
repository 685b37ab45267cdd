"""GGUF: a plain Hugging Face model directory written as one llama.cpp file, with the gguf package.

No llama.cpp build: the metadata, the vocabulary (gguf_vocab.py) and the tensors are written with
`gguf.GGUFWriter`, quantized with `gguf.quants.quantize` (numpy), following llama.cpp's
convert_hf_to_gguf.py:

    families        one row each in gguf_families.FAMILIES (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE,
                    Mixtral, Gemma 2, Gemma 3, Phi-3, Granite, OLMo 2, SmolLM3, GLM-4, Cohere,
                    gpt-oss): the llama.cpp arch,
                    the transforms (q/k permutation, Gemma's norm + 1, expert stacking) and the
                    metadata keys; anything else, or a config the arch's graph would compute
                    differently, is refused naming the family and what to use instead
    tensor names    gguf's own TensorNameMap for the arch, never written here
    tensor types    1-D tensors, norms and routers F32; the rest at --quant (f32, f16, bf16, q8_0);
                    a row length that is not a multiple of the 32-value block stays F16
    K-quants, q4_0  q2_k ... q6_k, q4_k_m ..., and q4_0: each tensor's type as llama-quantize chooses it
                    (q4_0: the output matrix, token_embd when tied, Q6_K, or Q8_0 for rows not a
                    multiple of 256; an 8-expert model's attn_v and attn_k Q8_0)
                    (kquant_recipes.py), its blocks written by kquants.py byte-identical to
                    llama.cpp's quantizer, with an importance matrix (imatrix.py) when given one;
                    tensors in llama-quantize's order (by layer, then name)

Tensors are streamed: the header is written from the safetensors headers, then each tensor is
read, converted and written in turn, so only one tensor (one layer's experts) is held in memory.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import MudpuppyError
from .gguf_families import (FAMILIES, Family, head_dim, notes_of, problems_of, range_problems, rope_parameters,
                            written_problems)
from .gguf_vocab import Vocab, build_vocab
from .kquant_plan import plan_k_quant
from .kquant_recipes import FILE_TYPES as K_FILE_TYPES, RECIPES
from .tensors import StoredTensor, model_tensors

QUANTS = ("f32", "f16", "bf16", "q8_0", "q4_0")
K_QUANTS = tuple(K_FILE_TYPES)


def supported_architectures() -> str:
    return ", ".join(FAMILIES)


def check_quant(quant: str) -> str:
    q = quant.lower()
    if q in QUANTS or q in K_QUANTS:
        return q
    raise MudpuppyError(f"--quant {quant}: GGUF quantizations are {', '.join(K_QUANTS + QUANTS)}")


# --------------------------------------------------------------------------- architecture

def family_of(config: dict, where: str) -> Family:
    """The family row for `config`, or one error naming the family and what to export instead."""
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in FAMILIES), None)
    if arch is None:
        named = ", ".join(archs) or f"model_type {config.get('model_type')!r}"
        raise MudpuppyError(f"{where}: {named} cannot be written as GGUF here; supported architectures: "
                            f"{supported_architectures()}. Use --format merged (safetensors, for llama.cpp's own "
                            "convert_hf_to_gguf.py or any other reader) or --format mlx instead")
    problems = problems_of(FAMILIES[arch], config)
    if problems:
        raise MudpuppyError(f"{where}: this {arch} uses {'; '.join(problems)}, which llama.cpp's "
                            f"{FAMILIES[arch].arch.lower()} graph would compute differently, so the GGUF would "
                            "not be the same model. Use --format merged or --format mlx instead")
    return FAMILIES[arch]


def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's rotary halves [x0..x(d/2-1) | x(d/2)..] per head to llama.cpp's interleaved
    pairs, as convert_hf_to_gguf.py's LlamaModel.permute (rows of q_proj/k_proj, or their biases)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(config: dict) -> np.ndarray:
    """The rope_freqs tensor llama.cpp applies for Llama 3.1-style scaling (convert_hf_to_gguf.py)."""
    rope, dim = rope_parameters(config), head_dim(config)
    freqs = 1.0 / (rope["theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


# --------------------------------------------------------------------------- tensors

@dataclass
class Planned:
    name: str                                 # GGUF name
    shape: tuple[int, ...]                    # logical shape (numpy order)
    qtype: Any                                # gguf.GGMLQuantizationType
    load: Callable[[], np.ndarray]            # float32 values, already permuted
    exact: bool = False                       # a K-quant file's tensor: llama.cpp's own bytes (kquants.py)
    weights: np.ndarray | None = None         # its importance matrix row ([experts *] columns)

    def encode(self) -> np.ndarray:
        from gguf.quants import quantize

        values = np.ascontiguousarray(self.load(), dtype=np.float32)
        if not self.exact or self.qtype.name in ("F32", "F16", "BF16"):
            return quantize(values, self.qtype)
        from .kquants import quantize as quantize_exact

        if self.weights is None or values.ndim < 3:
            return quantize_exact(values, self.qtype.name, self.weights)
        per_expert = self.weights.reshape(values.shape[0], values.shape[-1])   # llama-quant.cpp:784-786
        return np.stack([quantize_exact(v, self.qtype.name, w) for v, w in zip(values, per_expert)])

    def info(self) -> tuple[tuple[int, ...], np.dtype, int]:
        """(shape as stored, numpy dtype as stored, bytes) for the header, before any data is read."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        if self.qtype == GGMLQuantizationType.F32:
            return self.shape, np.dtype(np.float32), 4 * math.prod(self.shape)
        if self.qtype == GGMLQuantizationType.F16:
            return self.shape, np.dtype(np.float16), 2 * math.prod(self.shape)
        block, size = GGML_QUANT_SIZES[self.qtype]
        byte_shape = quant_shape_to_byte_shape(self.shape, self.qtype)
        return byte_shape, np.dtype(np.uint8), math.prod(self.shape) // block * size


def tensor_type(name: str, shape: tuple[int, ...], quant: str):
    """llama.cpp's choice: norms, routers and 1-D tensors F32, a row that does not fill whole blocks F16."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    if len(shape) <= 1 or name.endswith("_norm.weight") or ".ffn_gate_inp." in name or not name.endswith(".weight"):
        return T.F32
    qtype = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}[quant]
    if qtype == T.Q8_0 and shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        qtype = T.F16
    return qtype


@dataclass
class Source:
    """One tensor as Hugging Face names it once experts are stacked: its shape and a float32 loader."""
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]


PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
FUSED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<bias>_bias)?(?:\.weight)?$")


def source_tensors(config: dict, family: Family, stored: dict[str, StoredTensor], where: str) -> dict[str, Source]:
    """`stored` under the names gguf's TensorNameMap knows: per-expert matrices stacked into
    `...experts.<proj>.weight` [E, out, in], transformers 5's fused expert tensors split into gate and
    up (in the family's layout), and gpt-oss's bare `sinks` given their `.weight`."""
    out: dict[str, Source] = {}
    groups: dict[tuple[str, str], dict[int, StoredTensor]] = {}
    for key, tensor in stored.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if key.endswith(("_blocks", "_scales")):
            raise MudpuppyError(f"{where}: {key} is an MXFP4-packed expert tensor; export the bf16 checkpoint "
                                "(or a merged export of this one) to GGUF")
        if (m := PER_EXPERT.match(key)) and family.experts:
            groups.setdefault((m["prefix"], m["proj"]), {})[int(m["expert"])] = tensor
        elif (m := FUSED.match(key)) and family.experts:
            out.update(split_fused(m["prefix"], m["proj"], bool(m["bias"]), tensor, family.experts))
        elif key.endswith(".sinks"):
            out[key + ".weight"] = Source(tensor.shape, tensor.float32)
        else:
            out[key] = Source(tensor.shape, tensor.float32)
    count = _expert_count(config)
    for (prefix, proj), by_index in groups.items():
        if sorted(by_index) != list(range(count)):
            raise MudpuppyError(f"{where}: {prefix}.*.{proj} holds experts {sorted(by_index)}, config.json "
                                f"says {count}")
        parts = [by_index[i] for i in range(count)]
        out[f"{prefix}.{proj}.weight"] = Source((count, *parts[0].shape),
                                                lambda parts=parts: np.stack([t.float32() for t in parts]))
    return out


def _expert_count(config: dict) -> int:
    return int(config.get("num_local_experts") or config.get("num_experts") or 0)


def split_fused(prefix: str, proj: str, bias: bool, tensor: StoredTensor, layout: str) -> dict[str, Source]:
    """transformers 5's fused experts as llama.cpp's stacked [E, out, in] gate / up / down.
    "halves": gate_up_proj [E, 2F, H], gate rows then up rows (Qwen3-MoE, Mixtral: `.chunk(2)`);
    down_proj [E, H, F] already (out, in). "interleaved": gpt-oss's gate_up_proj [E, H, 2F] is
    (in, out) with gate and up in alternate columns (`[..., ::2]`, `[..., 1::2]`), down_proj
    [E, F, H] (in, out), and both have biases alike."""
    suffix = ".bias" if bias else ".weight"
    in_out = layout == "interleaved" and not bias

    def oriented() -> np.ndarray:
        values = tensor.float32()
        return values.swapaxes(-1, -2) if in_out else values

    shape = tensor.shape[:-2] + tensor.shape[:-3:-1] if in_out else tensor.shape
    if proj == "down_proj":
        return {f"{prefix}.down_proj{suffix}": Source(tuple(shape), oriented)}
    axis = len(shape) - (1 if bias else 2)          # the 2F axis
    half = shape[axis] // 2
    if layout == "interleaved":
        picks = (slice(0, None, 2), slice(1, None, 2))
    else:
        picks = (slice(0, half), slice(half, None))
    half_shape = tuple(half if i == axis else n for i, n in enumerate(shape))
    out = {}
    for name, pick in zip(("gate_proj", "up_proj"), picks):
        index = (slice(None),) * axis + (pick,)
        out[f"{prefix}.{name}{suffix}"] = Source(half_shape,
                                                 lambda index=index: np.ascontiguousarray(oriented()[index]))
    return out


def plan_tensors(config: dict, family: Family, stored: dict[str, StoredTensor], quant: str,
                 where: str) -> list[Planned]:
    import gguf

    arch = getattr(gguf.MODEL_ARCH, family.arch)
    names = gguf.get_tensor_name_map(arch, int(config["num_hidden_layers"]))
    tied = bool(config.get("tie_word_embeddings", False))
    heads = {"attn_q": int(config["num_attention_heads"]),
             "attn_k": int(config.get("num_key_value_heads") or config["num_attention_heads"])}
    if not tied and "lm_head.weight" not in stored:
        raise MudpuppyError(f"{where}: config.json says the output head is not tied to the embedding, "
                            "but there is no lm_head.weight")
    plan, unmapped = [], []
    for key, src in source_tensors(config, family, stored, where).items():
        if tied and key == "lm_head.weight":
            continue
        target = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if target is None:
            unmapped.append(key)
            continue
        kind = target.split(".")[-2]
        rows = heads.get(kind) if family.permute_qk else None
        shift = family.norm_shift if target.endswith("norm.weight") else 0.0
        plan.append(Planned(target, src.shape, tensor_type(target, src.shape, quant),
                            _transformed(src.load, rows, shift)))
        if tied and family.output == "required" and target == "token_embd.weight":
            plan.append(Planned("output.weight", src.shape, tensor_type("output.weight", src.shape, quant),
                                src.load))
    if unmapped:
        raise MudpuppyError(f"{where}: tensors with no GGUF name for {family.arch.lower()}: "
                            f"{', '.join(unmapped[:5])}{' ...' if len(unmapped) > 5 else ''}")
    plan += extra_tensors(config, family)
    return plan


def _transformed(load: Callable[[], np.ndarray], rows: int | None, shift: float) -> Callable[[], np.ndarray]:
    def value() -> np.ndarray:
        values = load()
        if rows:
            values = permute_rotary(values, rows)
        return values + np.float32(shift) if shift else values
    return value


def extra_tensors(config: dict, family: Family) -> list[Planned]:
    """Tensors llama.cpp wants that the checkpoint does not hold: rope frequency factors."""
    import gguf

    F32 = gguf.GGMLQuantizationType.F32
    rope = rope_parameters(config)
    named = lambda t: gguf.TENSOR_NAMES[t] + ".weight"    # noqa: E731
    if rope["type"] == "llama3":
        factors = llama3_rope_factors(config)
        return [Planned(named(gguf.MODEL_TENSOR.ROPE_FREQS), factors.shape, F32, lambda f=factors: f)]
    if rope["type"] == "longrope":          # Phi3MiniModel.generate_extra_tensors
        out = []
        for key, tensor in (("long_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_LONG),
                            ("short_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)):
            factors = np.asarray(rope[key], dtype=np.float32)
            out.append(Planned(named(tensor), factors.shape, F32, lambda f=factors: f))
        return out
    return []

# --------------------------------------------------------------------------- writing

def model_name(base: dict | None, finetune: str | None, fallback: str) -> str:
    """general.name: the base model's name (its Hub id's name part, else the directory or file it was given
    as), a fine-tune's name (its run's or adapter's directory) after it: "SmolLM2-135M-Instruct-qs".

    llama.cpp reads this key: a name containing "phi3" or "phi-3" gets Phi-3's token attributes
    (llama-vocab.cpp), and loading a vocabulary without Phi-3's </s>, <unk> and <s> then fails. A name
    from the base's Hub id says what llama.cpp's own converter would; a fine-tune's suffix that would
    change whether the name says "phi3" is left out."""
    base = base or {}
    if base.get("hub_id"):
        stem = base["hub_id"].rsplit("/", 1)[-1]
    elif base.get("given"):
        given = str(base["given"]).rstrip("/\\")
        stem = Path(given).name.removesuffix(".gguf") or given
    else:
        stem = fallback
    if not finetune or finetune == stem:
        return stem
    named = f"{stem}-{finetune}"
    return named if names_phi3(named) == names_phi3(stem) else stem


def names_phi3(name: str) -> bool:
    """llama.cpp's test (llama_vocab::impl::load) for giving a vocabulary Phi-3's token attributes."""
    return any(s in name.lower() for s in ("phi3", "phi-3"))


def write_gguf(model_dir: Path, tokenizer, chat_template: str | None, quant: str, path: Path, name: str,
               eot_id: int | None = None, base_model: str | None = None,
               imatrix: dict[str, np.ndarray] | None = None) -> dict:
    """Write `model_dir` (a plain HF causal LM) as `path`; returns what was written, for export.json.
    `name` is general.name (`model_name`); `base_model`, the Hub id a fine-tune was trained from, goes
    to general.base_model.* as llama.cpp's converter writes it. `imatrix` (GGUF tensor name -> per-column
    importance, imatrix.py) weights a K-quant's blocks as llama-quantize's --imatrix does."""
    import gguf

    quant = check_quant(quant)
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    where = str(model_dir)
    family = family_of(config, where)
    refuse_values(where, "config.json values", range_problems(config))
    if imatrix is not None and quant not in K_QUANTS:
        raise MudpuppyError(f"--imatrix weights K-quants ({', '.join(K_QUANTS)}); --quant {quant} does not use one")
    vocab = build_vocab(tokenizer, int(config["vocab_size"]), chat_template, eot_id)
    if quant in RECIPES:            # llama-quantize's per-tensor rules: the K-quants, and q4_0's output Q6_K
        plan = plan_k_quant(config, family, plan_tensors(config, family, model_tensors(model_dir), "f16", where),
                            quant, imatrix, where)
    else:
        plan = plan_tensors(config, family, model_tensors(model_dir), quant, where)

    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, family.arch)])
    add_model_metadata(writer, config, family, quant, name, base_model)
    add_vocab(writer, vocab)
    refuse_values(where, "GGUF metadata", written_problems(writer))
    for p in plan:
        shape, dtype, nbytes = p.info()
        writer.add_tensor_info(p.name, shape, dtype, nbytes, raw_dtype=p.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for p in plan:
        writer.write_tensor_data(p.encode())
    writer.close()
    types: dict[str, int] = {}
    for p in plan:
        types[p.qtype.name] = types.get(p.qtype.name, 0) + 1
    record = {"file": path.name, "architecture": gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, family.arch)],
              "name": name, "notes": notes_of(family, config), "quant": quant, "tensor_types": types,
              "tokenizer": vocab.describe(), "special_ids": vocab.special_ids,
              "add_bos": vocab.add_bos, "bytes": path.stat().st_size}
    if imatrix is not None:
        record["imatrix_tensors"] = sum(p.weights is not None for p in plan)
    return record


def refuse_values(where: str, what: str, problems: list[str]) -> None:
    if problems:
        raise MudpuppyError(f"{where}: cannot be written as GGUF: {what} out of the range GGUF stores: "
                            f"{'; '.join(problems[:5])}. Correct the model's config.json")


FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
              "q4_0": "MOSTLY_Q4_0", **{k: v[1] for k, v in K_FILE_TYPES.items()}}


def add_model_metadata(writer, config: dict, family: Family, quant: str, name: str,
                       base_model: str | None = None) -> None:
    """The keys every llama.cpp loader reads (llama_model_base::load_hparams), the rope scaling, then
    the family's own (gguf_families: experts, windows, soft-capping, Granite's scales...)."""
    import gguf

    rope = rope_parameters(config)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    if base_model:
        organization, _, repo = base_model.rpartition("/")
        writer.add_base_model_count(1)
        writer.add_base_model_name(0, repo)
        if organization:
            writer.add_base_model_organization(0, organization)
        writer.add_base_model_repo_url(0, f"https://huggingface.co/{base_model}")
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or config["num_attention_heads"]))
    writer.add_rope_freq_base(rope["theta"])
    if config.get("rms_norm_eps") is not None:          # RMSNorm families
        writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    if config.get("layer_norm_eps") is not None:        # LayerNorm ones (Cohere), as TextModel writes both
        writer.add_layer_norm_eps(float(config["layer_norm_eps"]))
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    add_rope_scaling(writer, config, rope)
    for add in family.keys:
        add(writer, config)
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[quant]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def add_rope_scaling(writer, config: dict, rope: dict) -> None:
    """As TextModel.set_gguf_parameters (linear, yarn) and Phi3MiniModel (longrope: the factors are
    tensors, see extra_tensors); llama3 is the rope_freqs tensor alone."""
    import gguf

    if rope["type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope["type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        for key, add in (("extrapolation_factor", writer.add_rope_scaling_yarn_ext_factor),
                         ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(float(rope[key]))
    elif rope["type"] == "longrope":
        original = int(rope.get("original_max_position_embeddings") or config["original_max_position_embeddings"])
        scale = config["max_position_embeddings"] / original
        factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        writer.add_rope_scaling_attn_factors(float(rope.get("attention_factor") or factor))


def add_vocab(writer, vocab: Vocab) -> None:
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    for kind, token_id in vocab.special_ids.items():
        getattr(writer, f"add_{kind}_token_id")(token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)
