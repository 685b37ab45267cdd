"""GGUF: a plain Hugging Face model directory written as one llama.cpp file, with the gguf package.

No llama.cpp build: the metadata, the vocabulary (gguf_vocab.py) and the tensors are written with
`gguf.GGUFWriter`, quantized with `gguf.quants.quantize` (numpy), following llama.cpp's
convert_hf_to_gguf.py:

    architectures   LlamaForCausalLM and MistralForCausalLM as "llama" (llama.cpp runs Mistral
                    as llama), Qwen2ForCausalLM as "qwen2"; anything else is an error naming these
    q/k layout      llama's q_proj/k_proj rows are permuted from Hugging Face's half-split rotary
                    layout to the interleaved one llama.cpp computes with (qwen2 uses the same
                    half-split "neox" rotation as Hugging Face: no permutation)
    tensor types    1-D tensors and norms F32; the rest at --quant (f32, f16, bf16, q8_0, q4_0);
                    a row length that is not a multiple of the 32-value block stays F16; in q4_0
                    the output matrix (token_embd when tied) is Q8_0, where llama-quantize
                    would pick Q6_K (Q8_0 for rows not a multiple of 256), which gguf cannot write
    K-quants        q4_k_m, q5_k_m, q6_k, ...: the f16 file is handed to an installed
                    `llama-quantize` found on PATH; without one, a clear error

Tensors are streamed: the header is written from the safetensors headers, then each tensor is
read, converted and written in turn, so only one tensor is ever held in memory.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import MudpuppyError
from .gguf_vocab import Vocab, build_vocab
from .tensors import StoredTensor, model_tensors

QUANTS = ("f32", "f16", "bf16", "q8_0", "q4_0")
K_QUANTS = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")
LLAMA_QUANTIZE = "llama-quantize"


@dataclass(frozen=True)
class Family:
    arch: str               # gguf.MODEL_ARCH member name
    permute_qk: bool        # llama's rotary layout differs from Hugging Face's
    biases: bool            # q/k/v biases allowed (qwen2)


FAMILIES = {
    "LlamaForCausalLM": Family("LLAMA", permute_qk=True, biases=False),
    "MistralForCausalLM": Family("LLAMA", permute_qk=True, biases=False),
    "Qwen2ForCausalLM": Family("QWEN2", permute_qk=False, biases=True),
}
ROPE_TYPES = ("default", "linear", "llama3")


def supported_architectures() -> str:
    return ", ".join(FAMILIES)


def check_quant(quant: str) -> str:
    q = quant.lower()
    if q in QUANTS or q in K_QUANTS:
        return q
    raise MudpuppyError(f"--quant {quant}: GGUF quantizations are {', '.join(QUANTS)} (written here) and the "
                        f"K-quants {', '.join(K_QUANTS)} (through an installed {LLAMA_QUANTIZE})")


def check_k_quant_tool(quant: str) -> str | None:
    """The llama-quantize executable a K-quant needs; None for the types written here."""
    if quant not in K_QUANTS:
        return None
    tool = shutil.which(LLAMA_QUANTIZE)
    if tool is None:
        raise MudpuppyError(
            f"--quant {quant} is a K-quant, which only llama.cpp's {LLAMA_QUANTIZE} writes, and none is on PATH. "
            f"Install llama.cpp's tools (a release binary or your package manager; mudpuppy never builds it), "
            f"or export with --quant q8_0 or q4_0, which need nothing else")
    return tool


# --------------------------------------------------------------------------- architecture

def family_of(config: dict, where: str) -> Family:
    archs = config.get("architectures") or []
    family = next((FAMILIES[a] for a in archs if a in FAMILIES), None)
    if family is None:
        named = ", ".join(archs) or f"model_type {config.get('model_type')!r}"
        raise MudpuppyError(f"{where}: {named} cannot be written as GGUF here; supported architectures: "
                            f"{supported_architectures()} (export --format merged or mlx works for any causal LM)")
    problems = []
    if config.get("mlp_bias"):
        problems.append("mlp_bias: true")
    if config.get("attention_bias") and not family.biases:
        problems.append("attention_bias: true")
    if config.get("use_sliding_window"):
        problems.append("use_sliding_window: true")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act: {config.get('hidden_act')}")
    rope = rope_parameters(config)
    if rope["type"] not in ROPE_TYPES:
        problems.append(f"rope scaling {rope['type']!r} (written here: {', '.join(ROPE_TYPES)})")
    if problems:
        raise MudpuppyError(f"{where}: this {archs[0]} uses {'; '.join(problems)}, which the GGUF writer does not "
                            "map; export --format merged or mlx instead")
    return family


def rope_parameters(config: dict) -> dict:
    """rope_theta and scaling from transformers 5's rope_parameters or the older top-level keys."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or params.get("type") or "default"
    return {**params, "type": kind, "theta": float(theta)}


def head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


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

    def encode(self) -> np.ndarray:
        from gguf.quants import quantize

        return quantize(np.ascontiguousarray(self.load(), dtype=np.float32), self.qtype)

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


def tensor_type(name: str, shape: tuple[int, ...], quant: str, output: bool):
    """llama.cpp's choice: norms and 1-D tensors F32, a row that does not fill whole blocks F16."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    if len(shape) <= 1 or name.endswith("_norm.weight"):
        return T.F32
    qtype = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}[quant]
    if qtype == T.Q4_0 and output:
        qtype = T.Q8_0
    if qtype in (T.Q8_0, T.Q4_0) and shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        qtype = T.F16
    return qtype


def plan_tensors(config: dict, family: Family, stored: dict[str, StoredTensor], quant: str,
                 where: str) -> list[Planned]:
    import gguf

    arch = getattr(gguf.MODEL_ARCH, family.arch)
    n_layers = int(config["num_hidden_layers"])
    names = gguf.get_tensor_name_map(arch, n_layers)
    tied = bool(config.get("tie_word_embeddings", False))
    n_head = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_head)
    if not tied and "lm_head.weight" not in stored:
        raise MudpuppyError(f"{where}: config.json says the output head is not tied to the embedding, "
                            "but there is no lm_head.weight")
    plan, unmapped = [], []
    for key, tensor in stored.items():
        if key.endswith("rotary_emb.inv_freq") or (tied and key == "lm_head.weight"):
            continue
        target = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if target is None:
            unmapped.append(key)
            continue
        heads = n_head if ".q_proj." in key else n_kv if ".k_proj." in key else None
        load = _loader(tensor, heads if family.permute_qk else None)
        output = target == "output.weight" or (tied and target == "token_embd.weight")
        plan.append(Planned(target, tensor.shape, tensor_type(target, tensor.shape, quant, output), load))
    if unmapped:
        raise MudpuppyError(f"{where}: tensors with no GGUF name for {family.arch.lower()}: "
                            f"{', '.join(unmapped[:5])}{' ...' if len(unmapped) > 5 else ''}")
    if rope_parameters(config)["type"] == "llama3":
        factors = llama3_rope_factors(config)
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        plan.append(Planned(name, factors.shape, gguf.GGMLQuantizationType.F32, lambda f=factors: f))
    return plan


def _loader(tensor: StoredTensor, heads: int | None) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        values = tensor.float32()
        return permute_rotary(values, heads) if heads else values
    return load


# --------------------------------------------------------------------------- writing

def write_gguf(model_dir: Path, tokenizer, chat_template: str | None, quant: str, path: Path, name: str,
               eot_id: int | None = None) -> dict:
    """Write `model_dir` (a plain HF causal LM) as `path`; returns what was written, for export.json."""
    import gguf

    quant = check_quant(quant)
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    where = str(model_dir)
    family = family_of(config, where)
    tool = check_k_quant_tool(quant)
    vocab = build_vocab(tokenizer, int(config["vocab_size"]), chat_template, eot_id)
    direct = "f16" if tool else quant
    plan = plan_tensors(config, family, model_tensors(model_dir), direct, where)
    target = path.with_name(path.stem + ".f16.tmp.gguf") if tool else path

    writer = gguf.GGUFWriter(str(target), gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, family.arch)])
    add_model_metadata(writer, config, family, direct, name)
    add_vocab(writer, vocab)
    for p in plan:
        shape, dtype, nbytes = p.info()
        writer.add_tensor_info(p.name, shape, dtype, nbytes, raw_dtype=p.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for p in plan:
        writer.write_tensor_data(p.encode())
    writer.close()
    if tool:
        run_llama_quantize(tool, target, path, quant)
        target.unlink()
    types: dict[str, int] = {}
    for p in plan:
        types[p.qtype.name] = types.get(p.qtype.name, 0) + 1
    return {"file": path.name, "architecture": gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, family.arch)],
            "quant": quant, "tensor_types": types if not tool else {"written by llama-quantize": quant.upper()},
            "tokenizer": vocab.describe(), "special_ids": vocab.special_ids,
            "add_bos": vocab.add_bos, "bytes": path.stat().st_size}


FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
              "q4_0": "MOSTLY_Q4_0"}


def add_model_metadata(writer, config: dict, family: Family, quant: str, name: str) -> None:
    import gguf

    rope = rope_parameters(config)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or config["num_attention_heads"]))
    writer.add_rope_freq_base(rope["theta"])
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(int(config["vocab_size"]))
    dim = head_dim(config)
    if family.arch == "LLAMA":
        writer.add_rope_dimension_count(dim)
    if dim != config["hidden_size"] // config["num_attention_heads"]:
        writer.add_key_length(dim)
        writer.add_value_length(dim)
    if rope["type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[quant]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


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


def run_llama_quantize(tool: str, source: Path, target: Path, quant: str) -> None:
    done = subprocess.run([tool, str(source), str(target), quant.upper()], capture_output=True, text=True)
    if done.returncode != 0 or not target.is_file():
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise MudpuppyError(f"{tool} {quant.upper()} failed (exit {done.returncode}):\n{tail}")
