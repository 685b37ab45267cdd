"""The GPTQ checkpoint layout (AutoGPTQ's "v1" format, which transformers, optimum, GPTQModel, vLLM and
TGI read), packed and unpacked in plain torch.

For a linear layer with `in` inputs, `out` outputs, `bits` bits and groups of `group_size` inputs:

    qweight  int32 [in * bits / 32, out]   codes, packed along the input dimension
    qzeros   int32 [groups, out * bits / 32]  zero point minus one, packed along the output dimension
    scales   fp16  [groups, out]
    g_idx    int32 [in]                     the group of each input column (act-order permutes it)
    bias     fp16  [out]                    when the layer has one

and the weight is ``W[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o])``.

Packing: each run of 32 consecutive values along the packed dimension forms a little-endian bit
stream of ``32 * bits`` bits (value k at bits ``k*bits .. k*bits + bits - 1``), cut into `bits`
int32 words. For 2, 4 and 8 bits that is simply value j of a word at bits ``j*bits``; for 3 bits
some values straddle two words, exactly as AutoGPTQ's packer lays them out.

The "v1" zero point is stored minus one. Readers differ on what they do with a stored value whose
`zero - 1` wrapped below 0 (some mask after adding one back, some do not, GPTQModel's v1->v2
conversion carries into the next field), so `sweep.py` never produces a zero point of
0: every reader then gets the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .....errors import MudpuppyError

PACK_WIDTH = 32                 # values per packed run; both packed dimensions must be multiples of it
SUPPORTED_BITS = (2, 3, 4, 8)
FORMAT = "gptq"                 # checkpoint_format of AutoGPTQ v1 (GPTQModel's "gptq_v2" stores zeros as is)


@dataclass
class PackedLinear:
    """One quantized linear layer in the checkpoint's tensors."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor
    bias: torch.Tensor | None = None

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        named = {"qweight": self.qweight, "qzeros": self.qzeros, "scales": self.scales, "g_idx": self.g_idx}
        if self.bias is not None:
            named["bias"] = self.bias
        return {f"{prefix}.{k}": v.contiguous() for k, v in named.items()}


def check_packable(name: str, in_features: int, out_features: int) -> str | None:
    """Why a layer of this shape cannot be stored in the GPTQ layout, or None."""
    bad = [f"{what} {n}" for what, n in (("in_features", in_features), ("out_features", out_features))
           if n % PACK_WIDTH]
    if bad:
        return f"{name}: {' and '.join(bad)} not a multiple of {PACK_WIDTH}, which the GPTQ layout packs by"
    return None


def _bit_positions(bits: int) -> list[tuple[int, int]]:
    """(word, bit offset) of each of the 32 values of a packed run."""
    return [divmod(k * bits, 32) for k in range(PACK_WIDTH)]


def pack_last(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer `values` in [0, 2**bits) along the last dimension into int32 words."""
    if bits not in SUPPORTED_BITS:
        raise MudpuppyError(f"GPTQ packs 2, 3, 4 or 8 bits, not {bits}")
    *lead, n = values.shape
    if n % PACK_WIDTH:
        raise MudpuppyError(f"cannot pack {n} values: the GPTQ layout packs runs of {PACK_WIDTH}")
    v = values.to(torch.int64).reshape(*lead, n // PACK_WIDTH, PACK_WIDTH)
    if bool(((v < 0) | (v >= 1 << bits)).any()):
        raise MudpuppyError(f"values outside [0, {(1 << bits) - 1}] cannot be packed in {bits} bits")
    words = torch.zeros(*lead, n // PACK_WIDTH, bits, dtype=torch.int64, device=values.device)
    mask32 = 0xFFFFFFFF
    for k, (word, offset) in enumerate(_bit_positions(bits)):
        words[..., word] |= (v[..., k] << offset) & mask32
        if offset + bits > 32:                        # straddles into the next word (3 bits only)
            words[..., word + 1] |= v[..., k] >> (32 - offset)
    words = words.reshape(*lead, n // PACK_WIDTH * bits)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_last(words: torch.Tensor, bits: int, n: int | None = None) -> torch.Tensor:
    """The inverse of `pack_last`: int32 words -> integer values (int32) along the last dimension."""
    if bits not in SUPPORTED_BITS:
        raise MudpuppyError(f"GPTQ packs 2, 3, 4 or 8 bits, not {bits}")
    *lead, m = words.shape
    if m % bits:
        raise MudpuppyError(f"{m} packed words do not hold whole runs of {PACK_WIDTH} {bits}-bit values")
    mask = (1 << bits) - 1
    if 32 % bits == 0:                                # 2, 4, 8: whole values per word, one shift each
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
        out = (words.unsqueeze(-1) >> shifts) & mask          # arithmetic shift; the mask drops the sign
        out = out.reshape(*lead, m * (32 // bits))
    else:
        w = words.to(torch.int64).reshape(*lead, m // bits, bits) & 0xFFFFFFFF
        parts = []
        for word, offset in _bit_positions(bits):
            value = w[..., word] >> offset
            if offset + bits > 32:
                value = value | (w[..., word + 1] << (32 - offset))
            parts.append(value & mask)
        out = torch.stack(parts, dim=-1).reshape(*lead, m // bits * PACK_WIDTH).to(torch.int32)
    return out if n is None else out[..., :n]


def pack_linear(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
                bits: int, bias: torch.Tensor | None = None) -> PackedLinear:
    """The checkpoint tensors of one layer from its codes [out, in], scales and integer zero points
    [groups, out] and g_idx [in]."""
    maxq = (1 << bits) - 1
    if bool((zeros < 1).any() | (zeros > maxq).any()):
        raise MudpuppyError(f"GPTQ v1 zero points must lie in [1, {maxq}] to read back the same in every tool")
    return PackedLinear(
        qweight=pack_last(codes, bits).t().contiguous(),                        # packed along the inputs
        qzeros=pack_last((zeros.to(torch.int64) - 1), bits),                   # v1: zero point minus one
        scales=scales.to(torch.float16).contiguous(),
        g_idx=g_idx.to(torch.int32).contiguous(),
        bias=None if bias is None else bias.detach().to(torch.float16),
    )


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [in, out] from qweight [in * bits / 32, out]."""
    return unpack_last(qweight.t().contiguous(), bits).t()


def unpack_zeros(qzeros: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """Zero points [groups, out] (v1: the stored value plus one)."""
    return (unpack_last(qzeros, bits, out_features) + 1) & ((1 << bits) - 1)


def dequantize_packed(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                      bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [out, in] the tensors of one layer stand for, computed in fp32 and returned in `dtype`."""
    codes = unpack_codes(qweight, bits)                          # [in, out]
    zeros = unpack_zeros(qzeros, bits, scales.shape[1])          # [groups, out]
    g = g_idx.long()
    weight_t = scales.float()[g] * (codes - zeros[g]).float()    # [in, out]
    return weight_t.t().to(dtype)


def quantization_config(bits: int, group_size: int, sym: bool, desc_act: bool, damp_percent: float,
                        true_sequential: bool, damp_auto_increment: float, version: str,
                        modules_in_block: list[list[str]] | None = None) -> dict:
    """config.json's `quantization_config`, with the keys optimum's GPTQQuantizer and GPTQModel write
    (`checkpoint_format` and its newer spelling `format` both say v1)."""
    config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "damp_percent": damp_percent,
        "true_sequential": true_sequential,
        "static_groups": False,
        "lm_head": False,
        "checkpoint_format": FORMAT,
        "format": FORMAT,
        "pack_dtype": "int32",
        "model_file_base_name": "model",
        "meta": {"quantizer": [f"mudpuppy:{version}"], "damp_auto_increment": damp_auto_increment},
    }
    if modules_in_block:
        config["modules_in_block_to_quantize"] = modules_in_block
    return config


@dataclass(frozen=True)
class GptqSettings:
    """What a reader needs from `quantization_config` to rebuild the weights."""

    bits: int
    group_size: int
    desc_act: bool
    sym: bool


def read_quantization_config(config: dict, where: str) -> GptqSettings | None:
    """The GPTQ settings of a config.json's `quantization_config`; None when the model is not GPTQ.
    A GPTQ config this reader cannot use is an error naming the key."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or str(qc.get("quant_method", "")).lower() != "gptq":
        return None
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or FORMAT).lower()
    problems = []
    if fmt != FORMAT:
        problems.append(f"checkpoint_format {fmt!r} (mudpuppy reads the v1 layout, 'gptq')")
    bits = qc.get("bits")
    if bits not in SUPPORTED_BITS:
        problems.append(f"bits {bits!r} (2, 3, 4 or 8)")
    if str(qc.get("pack_dtype", "int32")) != "int32":
        problems.append(f"pack_dtype {qc.get('pack_dtype')!r} (int32)")
    if qc.get("lm_head"):
        problems.append("lm_head: true (a quantized output head)")
    if problems:
        raise MudpuppyError(f"{where}: quantization_config: cannot read this GPTQ model: {'; '.join(problems)}")
    return GptqSettings(int(bits), int(qc.get("group_size", 128)), bool(qc.get("desc_act", False)),
                        bool(qc.get("sym", True)))
