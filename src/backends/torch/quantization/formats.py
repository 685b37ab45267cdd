"""4-bit weight formats in pure PyTorch: nibble packing, asymmetric int4 and OCP MXFP4.

A weight is ``[out_features, in_features]``. Groups (int4) and blocks (MXFP4)
run along ``in_features``, the dimension a matmul reduces over, so one scale
covers values that are summed together. Rows whose length does not fit the
group or block are padded on the right and the padding is sliced off again
when dequantizing. Everything here is vectorized over whole tensors and runs
unchanged on CPU, CUDA and ROCm.

int4 is asymmetric (min-max): each group stores its minimum and a step of
``(max - min) / 15``, so all 16 levels span the values actually present.
Symmetric int4 would spend levels on the side of zero a group does not reach
and, with a signed code, leave one of the 16 codes unused; min-max costs one
extra 16-bit number per group. The minimum is kept as a float rather than an
integer zero point so that the grid is not shifted by rounding the zero point.

MXFP4 follows the OCP Microscaling spec v1.0: blocks of 32 values share one
power-of-two scale stored as an E8M0 byte, each value is an FP4 E2M1 code.
"""

from __future__ import annotations

import functools

import torch

from ....errors import MudpuppyError

QUANT_BACKENDS = ("int4", "mxfp4")

INT4_LEVELS = 15  # highest code: 16 levels, 0..15
# bf16 keeps fp32's exponent range, so no weight's step or minimum can overflow
# or flush to zero; its short mantissa is harmless because codes are chosen
# against the stored (already rounded) step and minimum.
INT4_SCALE_DTYPE = torch.bfloat16

MX_BLOCK = 32  # OCP MX: values per shared scale
E8M0_BIAS = 127  # biased exponent byte; 255 would mean NaN and is never written
E8M0_MIN, E8M0_MAX = -127, 127
E2M1_EMAX = 2  # exponent of E2M1's largest normal value, 6 = 1.5 * 2**2
# The 8 magnitudes of E2M1 in code order (code = 2 exponent bits, 1 mantissa bit).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Halfway points between neighbouring magnitudes: the rounding boundaries.
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_SIGN = 0x8


# --------------------------------------------------------------------------- packing


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes (uint8, 0..15, even last dimension) two per byte.

    Element ``2i`` goes to the low nibble of byte ``i`` and ``2i + 1`` to its high
    nibble, so neighbours along a row share a byte.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got shape {tuple(codes.shape)}")
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`: uint8 codes, twice as many along the last dimension."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def pad_columns(weight: torch.Tensor, multiple: int, replicate: bool) -> torch.Tensor:
    """Pad the last dimension up to a multiple of `multiple`.

    `replicate` repeats each row's last value, which leaves a group's min and max
    unchanged; otherwise zeros are added, which leave a block's absolute max unchanged.
    """
    missing = -weight.shape[-1] % multiple
    if missing == 0:
        return weight
    if replicate:
        fill = weight[..., -1:].expand(*weight.shape[:-1], missing)
    else:
        fill = weight.new_zeros(*weight.shape[:-1], missing)
    return torch.cat((weight, fill), dim=-1)


# --------------------------------------------------------------------------- int4


def check_group_size(group_size: int | None) -> None:
    """Raise unless `group_size` is None (one group per row) or a positive even integer."""
    if group_size is None:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise MudpuppyError(
            f"quant_group_size must be a positive even integer (e.g. 64 or 128) or null for one scale "
            f"per row, got {group_size!r}"
        )


def choose_int4_group(in_features: int, group_size: int | None) -> int:
    """The group length actually used for a row of `in_features` values.

    A group never spans two rows, so a group_size of None, or one longer than the
    row, means a single group covering the row (rounded up to an even length).
    """
    row = in_features + in_features % 2
    if group_size is None or group_size >= row:
        return row
    return group_size


def quantize_int4(weight: torch.Tensor, group_size: int | None = 64) -> dict[str, torch.Tensor]:
    """Asymmetric int4: ``w ~= code * scale + min`` per group of `group_size` inputs.

    Returns ``qweight`` (uint8 ``[out, padded_in / 2]``), ``scales`` and ``mins``
    (bf16 ``[out, groups]``).
    """
    check_group_size(group_size)
    out_features, in_features = weight.shape
    group = choose_int4_group(in_features, group_size)
    grouped = pad_columns(weight.float(), group, replicate=True).view(out_features, -1, group)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = ((high - low) / INT4_LEVELS).to(INT4_SCALE_DTYPE)
    mins = low.to(INT4_SCALE_DTYPE)
    # Choose codes against the stored, rounded step and minimum, so dequantizing
    # lands on the nearest point of the grid that is actually kept.
    step = scales.float().unsqueeze(-1)
    safe_step = torch.where(step > 0, step, torch.ones_like(step))  # a constant group: every code is 0
    codes = ((grouped - mins.float().unsqueeze(-1)) / safe_step).round_().clamp_(0, INT4_LEVELS)
    qweight = pack_nibbles(codes.to(torch.uint8).view(out_features, -1))
    return {"qweight": qweight, "scales": scales, "mins": mins}


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, in_features: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rebuild ``[out, in_features]`` weights in `dtype` from `quantize_int4`'s tensors.

    The arithmetic runs in fp32 and is cast once at the end: one rounding instead
    of two, and on CPU about twice as fast as bf16 arithmetic (0.5 vs 1.1 ms for
    a 1536x576 weight).
    """
    out_features, groups = scales.shape
    codes = unpack_nibbles(qweight).float().view(out_features, groups, -1)
    weight = torch.addcmul(mins.float().unsqueeze(-1), codes, scales.float().unsqueeze(-1))
    return weight.view(out_features, -1)[:, :in_features].to(dtype)


# --------------------------------------------------------------------------- MXFP4


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to FP4 E2M1 codes (uint8: sign bit 3, magnitude index 0..7).

    Round to nearest, ties to the even code (mantissa bit 0) as IEEE rounding does;
    magnitudes past 6 saturate to 6, as the MX spec's conversion clamps.
    """
    magnitude = values.abs()
    bounds = torch.tensor(E2M1_MIDPOINTS, dtype=magnitude.dtype, device=magnitude.device)
    # right=False puts a value sitting exactly on a boundary on the lower code.
    codes = torch.bucketize(magnitude, bounds)
    on_boundary = magnitude == bounds[codes.clamp(max=len(E2M1_MIDPOINTS) - 1)]
    codes = codes + (on_boundary & (codes % 2 == 1)).to(codes.dtype)
    sign = (values < 0).to(torch.uint8) * E2M1_SIGN
    return codes.to(torch.uint8) | sign


def choose_shared_exponents(blocks: torch.Tensor) -> torch.Tensor:
    """Per-block power-of-two exponent X = floor(log2(amax)) - emax_elem (OCP MX v1.0, 6.3).

    Returns int32 exponents clamped to E8M0's range; an all-zero block gets the smallest.
    """
    amax = blocks.abs().amax(dim=-1)
    # frexp is exact: amax = m * 2**e with m in [0.5, 1), so floor(log2(amax)) = e - 1.
    _, exponent = torch.frexp(amax)
    shared = exponent - 1 - E2M1_EMAX
    shared = torch.where(amax > 0, shared, torch.full_like(shared, E8M0_MIN))
    return shared.clamp(E8M0_MIN, E8M0_MAX).to(torch.int32)


def quantize_mxfp4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """OCP MXFP4: blocks of 32 inputs, one E8M0 scale each, E2M1 values packed two per byte.

    Returns ``qweight`` (uint8 ``[out, padded_in / 2]``) and ``exponents``
    (uint8 ``[out, blocks]``, biased by 127).
    """
    out_features, _ = weight.shape
    blocks = pad_columns(weight.float(), MX_BLOCK, replicate=False).view(out_features, -1, MX_BLOCK)
    shared = choose_shared_exponents(blocks)
    scaled = torch.ldexp(blocks, -shared.unsqueeze(-1).float())  # exact: a power-of-two shift
    codes = encode_e2m1(scaled).view(out_features, -1)
    exponents = (shared + E8M0_BIAS).to(torch.uint8)
    return {"qweight": pack_nibbles(codes), "exponents": exponents}


def build_e2m1_table() -> torch.Tensor:
    """[16] fp32: the value of each 4-bit E2M1 code (sign bit 3), on the CPU.

    Code 8, E2M1's negative zero, decodes to +0.0: the sign of a zero weight changes no product, and
    inductor's CUDA kernel gave +0.0 where the eager lookup gave -0.0 (680 of 14,400 values of gpu_check's
    probe on an H200, 2026-11-27), so the bit-for-bit check sent every mxfp4 layer to the eager code."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    return torch.cat((magnitudes, -magnitudes)) + 0.0     # -0.0 + 0.0 is +0.0


@functools.lru_cache(maxsize=16)
def build_e2m1_byte_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 2]: the two E2M1 values held by each packed byte, low nibble first.

    One gather per byte replaces unpacking and a second lookup.
    """
    signed = build_e2m1_table()  # index = 4-bit code
    nibbles = unpack_nibbles(torch.arange(256, dtype=torch.uint8).view(256, 1)).long()
    return signed[nibbles].to(dtype=dtype, device=device)


def dequantize_mxfp4(qweight: torch.Tensor, exponents: torch.Tensor, in_features: int,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rebuild ``[out, in_features]`` weights in `dtype` from `quantize_mxfp4`'s tensors.

    Built in fp32, whose exponent range holds every E8M0 scale (fp16's does not),
    then cast once.
    """
    out_features, blocks = exponents.shape
    table = build_e2m1_byte_table(torch.float32, qweight.device)
    values = torch.index_select(table, 0, qweight.reshape(-1).int()).view(out_features, blocks, MX_BLOCK)
    scales = torch.exp2(exponents.float() - E8M0_BIAS).unsqueeze(-1)
    return (values * scales).view(out_features, -1)[:, :in_features].to(dtype)


# --------------------------------------------------------------------------- dispatch


def check_quant_backend(quant_backend: str) -> None:
    if quant_backend not in QUANT_BACKENDS:
        raise MudpuppyError(
            f"unknown quant_backend {quant_backend!r}: choose one of {', '.join(QUANT_BACKENDS)}"
        )


def quantize_weight(weight: torch.Tensor, quant_backend: str, group_size: int | None = 64) -> dict[str, torch.Tensor]:
    """Quantize a 2-D weight; the dict's tensors are everything `dequantize_weight` needs.

    `group_size` applies to int4 only: MXFP4 blocks are always 32 wide (OCP MX spec).
    """
    check_quant_backend(quant_backend)
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    if quant_backend == "int4":
        return quantize_int4(weight, group_size)
    return quantize_mxfp4(weight)


def dequantize_weight(tensors: dict[str, torch.Tensor], quant_backend: str, in_features: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    check_quant_backend(quant_backend)
    if quant_backend == "int4":
        return dequantize_int4(tensors["qweight"], tensors["scales"], tensors["mins"], in_features, dtype)
    return dequantize_mxfp4(tensors["qweight"], tensors["exponents"], in_features, dtype)
