"""K-quants (Q2_K ... Q6_K) written in numpy, byte-identical to llama.cpp's quantizer.

`quantize(rows, qtype, quant_weights)` returns what ggml's `quantize_<type>` (ggml-quants.c, the
function llama-quantize calls through ggml_quantize_chunk) writes for the same float32 rows:
without importance weights the `quantize_row_*_ref` path, with them the `quantize_row_*_impl` one
(weights per column, as llama.cpp's imatrix gives them). The 32-block fallback types a K-quant file
uses for rows that are not a multiple of 256 (Q4_0, Q5_0, Q5_1, Q8_0) come from gguf's own
quantizer without weights and from the `_impl` mirrors here with them.

Rows are processed a chunk at a time (about CHUNK values), every super-block of the chunk at once,
so memory stays flat whatever the tensor's size. Block layouts are ggml-common.h's block_q*_K.
The scale searches are in kquants_search.py; the checks against llama.cpp's own compiled code are
tests/export/test_kquants.py with the fixtures from benchmarks/kquant_fixtures.py.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .kquants_search import (F, GROUP_MAX_EPS, first_absmax, first_maxval, first_min, from_fp16, make_q3, make_qkx, make_qp, make_qx,
                             nearest_int, running_sum, to_fp16)

QK_K = 256
# Values quantized at once. 64K keeps each temporary (256 KB) in cache and off mmap: on the 2-core
# dev machine Q4_K of a 2048 x 2048 matrix took 1.4 s against 2.9 s with 1M-value chunks.
CHUNK = 1 << 16
THREADS = min(2, os.cpu_count() or 1)     # numpy releases the GIL inside each operation
BLOCK = {"Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
         "Q4_0": (32, 18), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34)}


def subblocks(x: np.ndarray, n: int) -> np.ndarray:
    """(S, 256) super-blocks as (n, S * 256 / n): sub-block b = s * (256 / n) + j, element-first."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


def per_block(v: np.ndarray, count: int) -> np.ndarray:
    """(S * count,) per-sub-block values as (S, count)."""
    return v.reshape(-1, count)


def superblock_sum_x2(x: np.ndarray) -> np.ndarray:
    """`sum_x2` over each super-block's 256 values in order (the C's running sum)."""
    xt = np.ascontiguousarray(x.T)
    return running_sum(xt * xt)


def first_max(v: np.ndarray, key: np.ndarray | None = None) -> np.ndarray:
    """Per row of (S, k): the value whose `key` (default itself) first exceeds the running best, from 0,
    as the C's `if (scale > max_scale)` loops."""
    key = v if key is None else key
    best_key = np.zeros(v.shape[0], F)
    best = np.zeros(v.shape[0], F)
    for j in range(v.shape[1]):
        take = key[:, j] > best_key
        best_key = np.where(take, key[:, j], best_key)
        best = np.where(take, v[:, j], best)
    return best


def requantize(xs: np.ndarray, d: np.ndarray, dm: np.ndarray | None, L: np.ndarray, lo: int, hi: int,
               offset: int) -> np.ndarray:
    """Codes again from the stored (fp16-rounded) scales, sub-blocks whose scale is 0 kept as searched:
    l = nearest_int((x + dm) / d) (or x / d) clamped to [lo, hi], plus `offset`."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        num = xs if dm is None else xs + dm
        l = np.clip(nearest_int(num / d), lo, hi) + offset
    return np.where(d != 0, l, L)


# --------------------------------------------------------------------------- packing

def pack_scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins in 12 bytes (Q4_K, Q5_K), as the C packs them (uint8 stores)."""
    ls, lm = ls.astype(np.int32), lm.astype(np.int32)
    out = np.zeros((ls.shape[0], 12), np.int32)
    out[:, 0:4], out[:, 4:8] = ls[:, :4], lm[:, :4]
    for j in range(4, 8):
        out[:, j + 4] = (ls[:, j] & 0xF) | ((lm[:, j] & 0xF) << 4)
        out[:, j - 4] |= (ls[:, j] >> 4) << 6
        out[:, j] |= (lm[:, j] >> 4) << 6
    return (out & 0xFF).astype(np.uint8)


def unpack_scales_k4(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """get_scale_min_k4 for j = 0..7: (S, 8) scales and mins as float32."""
    q = q.astype(np.int32)
    sc = np.concatenate([q[:, 0:4] & 63, (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], axis=1)
    return sc.astype(F), m.astype(F)


def pack_scales_q3(l: np.ndarray) -> np.ndarray:
    """Sixteen 6-bit scales in 12 bytes (Q3_K)."""
    l = l.astype(np.int32)
    out = np.zeros((l.shape[0], 12), np.int32)
    out[:, 0:8] = l[:, 0:8] & 0xF
    out[:, 0:8] |= (l[:, 8:16] & 0xF) << 4
    for j in range(16):
        out[:, 8 + j % 4] |= (l[:, j] >> 4) << (2 * (j // 4))
    return (out & 0xFF).astype(np.uint8)


def unpack_scales_q3(q: np.ndarray) -> np.ndarray:
    q = q.astype(np.int32)
    low = np.concatenate([q[:, 0:8] & 0xF, q[:, 0:8] >> 4], axis=1)
    high = np.stack([(q[:, 8 + j % 4] >> (2 * (j // 4))) & 3 for j in range(16)], axis=1)
    return ((low | (high << 4)) - 32).astype(np.int8).astype(F)


def pack_2bit(L: np.ndarray) -> np.ndarray:
    """(S, 256) codes in [0, 3] as 64 bytes: q[j/4 + l] = L[j+l] | L[j+l+32] << 2 | ... (j = 0, 128)."""
    L = L.reshape(-1, 2, 4, 32).astype(np.uint8)
    q = L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)
    return q.reshape(-1, 64)


def _k4_fit(X: np.ndarray, qw: np.ndarray | None, nmax: int):
    """Q4_K / Q5_K: (sub-block codes (32, S*8), 12 scale bytes (S, 12), d, dmin) before requantizing."""
    xs = subblocks(X, 32)
    if qw is None:                                  # quantize_row_q{4,5}_K_ref
        av_x = np.sqrt(running_sum(xs * xs) / F(32))
        search = (-1.0, 0.1, 20) if nmax == 15 else (-0.5, 0.1, 15)
        scales, mins, L = make_qkx(xs, av_x + np.abs(xs), nmax, *search, False)
        scales, mins = per_block(scales, 8), per_block(mins, 8)
        max_scale, max_min = first_max(scales), first_max(mins)
        with np.errstate(divide="ignore"):
            inv_scale = np.where(max_scale > 0, F(63) / max_scale, F(0))[:, None]
            inv_min = np.where(max_min > 0, F(63) / max_min, F(0))[:, None]
        ls = np.minimum(63, nearest_int(inv_scale * scales) & 0xFF)
        lm = np.minimum(63, nearest_int(inv_min * mins) & 0xFF)
        return xs, L, pack_scales_k4(ls, lm), max_scale / F(63), max_min / F(63)
    sigma2 = F(2) * superblock_sum_x2(X) / F(QK_K)  # quantize_row_q{4,5}_K_impl
    w = subblocks(qw, 32) * np.sqrt(np.repeat(sigma2, 8) + xs * xs)
    sw = np.ascontiguousarray(per_block(running_sum(w), 8).T)
    scales, mins, L = make_qkx(xs, w, nmax, -0.9, 0.05, 36, False)
    d, Ls = make_qp(np.ascontiguousarray(per_block(scales, 8).T), 63, sw)
    dmin, Lm = make_qp(np.ascontiguousarray(per_block(mins, 8).T), 63, sw)
    if nmax == 31:                                  # the Q5_K impl clamps, the Q4_K one does not
        Ls, Lm = np.minimum(63, Ls), np.minimum(63, Lm)
    return xs, L, pack_scales_k4(Ls.T, Lm.T), d, dmin


def _k4_codes(X, qw, nmax):
    xs, L, packed, d, dmin = _k4_fit(X, qw, nmax)
    dh, dminh = to_fp16(d), to_fp16(dmin)
    sc, m = unpack_scales_k4(packed)
    dd = (from_fp16(dh)[:, None] * sc).reshape(-1)
    dm = (from_fp16(dminh)[:, None] * m).reshape(-1)
    L = requantize(xs, dd, dm, L, 0, nmax, 0)
    head = np.concatenate([dh.reshape(-1, 1).view(np.uint8), dminh.reshape(-1, 1).view(np.uint8), packed], axis=1)
    return head, np.ascontiguousarray(L.T).reshape(-1, 4, 2, 32).astype(np.uint8)


def q4_k(X: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    head, L = _k4_codes(X, qw, 15)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([head, qs], axis=1)


def q5_k(X: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    head, L = _k4_codes(X, qw, 31)
    qs = ((L[:, :, 0] & 0xF) | ((L[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    high = ((L[:, :, 0] > 15).astype(np.uint8) | ((L[:, :, 1] > 15).astype(np.uint8) << 1))   # (S, 4, 32)
    qh = np.zeros((L.shape[0], 32), np.uint8)
    for c in range(4):
        qh |= high[:, c] << (2 * c)
    return np.concatenate([head, qh, qs], axis=1)


def q6_k(X: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    xs = subblocks(X, 16)
    scales, L = make_qx(xs, 32, None if qw is None else subblocks(qw, 16))
    scales = per_block(scales, 16)
    max_scale = first_max(scales, np.abs(scales))
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F(-128) / max_scale
        dh = to_fp16(F(1) / iscale)
        sc = (np.minimum(127, nearest_int(iscale[:, None] * scales)) & 0xFF).astype(np.uint8)
    dd = (from_fp16(dh)[:, None] * sc.view(np.int8).astype(F)).reshape(-1)
    L = requantize(xs, dd, None, L, -32, 31, 32)
    L = np.ascontiguousarray(L.T).reshape(-1, 2, 4, 32).astype(np.uint8)
    ql = np.concatenate([L[:, :, 0] & 0xF | (L[:, :, 2] & 0xF) << 4,
                         L[:, :, 1] & 0xF | (L[:, :, 3] & 0xF) << 4], axis=2).reshape(-1, 128)
    qh = (L[:, :, 0] >> 4 | (L[:, :, 1] >> 4) << 2 | (L[:, :, 2] >> 4) << 4 | (L[:, :, 3] >> 4) << 6).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc, dh.reshape(-1, 1).view(np.uint8)], axis=1)
    out[zero] = 0
    return out


def q3_k(X: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    xs = subblocks(X, 16)
    if qw is None:                                  # quantize_row_q3_K_ref
        scales, L = make_q3(xs, 4)
        scales = per_block(scales, 16)
        max_scale = first_max(scales, np.abs(scales))
        nonzero = (max_scale != 0)[:, None]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            iscale = F(-32) / max_scale
            l = (nearest_int(iscale[:, None] * scales) & 0xFF).astype(np.uint8).view(np.int8).astype(np.int32)
            packed = np.where(nonzero, pack_scales_q3(np.clip(l, -32, 31) + 32), np.uint8(0))
            d = np.where(nonzero[:, 0], F(1) / iscale, F(0))
    else:                                           # quantize_row_q3_K_impl
        sigma2 = F(2) * superblock_sum_x2(X) / F(QK_K)
        w = subblocks(qw, 16) * np.sqrt(np.repeat(sigma2, 16) + xs * xs)
        sw = np.ascontiguousarray(per_block(running_sum(w), 16).T)
        scales, L = make_qx(xs, 4, w)
        d, Ls = make_qx(np.ascontiguousarray(per_block(scales, 16).T), 32, sw)
        packed = pack_scales_q3(Ls.T)
    dh = to_fp16(d)
    dd = (from_fp16(dh)[:, None] * unpack_scales_q3(packed)).reshape(-1)
    L = np.ascontiguousarray(requantize(xs, dd, None, L, -4, 3, 4).T).reshape(-1, QK_K)
    high = L > 3
    L = np.where(high, L - 4, L)
    hmask = np.zeros((L.shape[0], 32), np.uint8)
    for k, part in enumerate(high.reshape(-1, 8, 32).transpose(1, 0, 2)):
        hmask |= part.astype(np.uint8) << k
    return np.concatenate([hmask, pack_2bit(L), packed, dh.reshape(-1, 1).view(np.uint8)], axis=1)


def q2_k(X: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    xs = subblocks(X, 16)
    if qw is None:                                  # quantize_row_q2_K_ref
        scales, mins, L = make_qkx(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
        scales, mins = per_block(scales, 16), per_block(mins, 16)
        max_scale, max_min = first_max(scales), first_max(mins)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ls = np.where((max_scale > 0)[:, None], nearest_int((F(15) / max_scale)[:, None] * scales), 0)
            lm = np.where((max_min > 0)[:, None], nearest_int((F(15) / max_min)[:, None] * mins), 0)
        sc = (ls | (lm << 4)) & 0xFF
        d = np.where(max_scale > 0, max_scale / F(15), F(0))
        dmin = np.where(max_min > 0, max_min / F(15), F(0))
    else:                                           # quantize_row_q2_K_impl
        sigma2 = superblock_sum_x2(X) / F(QK_K)
        w = subblocks(qw, 16) * np.sqrt(np.repeat(sigma2, 16) + xs * xs)
        sw = np.ascontiguousarray(per_block(running_sum(w), 16).T)
        scales, mins, L = make_qkx(xs, w, 3, -0.9, 0.05, 36, False)
        d, Ls = make_qp(np.ascontiguousarray(per_block(scales, 16).T), 15, sw)
        dmin, Lm = make_qp(np.ascontiguousarray(per_block(mins, 16).T), 15, sw)
        sc = ((Ls | (Lm << 4)) & 0xFF).T
    sc = sc.astype(np.uint8)
    dh, dminh = to_fp16(d), to_fp16(dmin)
    dd = (from_fp16(dh)[:, None] * (sc & 0xF).astype(F)).reshape(-1)
    dm = (from_fp16(dminh)[:, None] * (sc >> 4).astype(F)).reshape(-1)
    L = np.ascontiguousarray(requantize(xs, dd, dm, L, 0, 3, 0).T).reshape(-1, QK_K)
    return np.concatenate([sc, pack_2bit(L), dh.reshape(-1, 1).view(np.uint8), dminh.reshape(-1, 1).view(np.uint8)],
                          axis=1)


# --------------------------------------------------------------------------- 32-block fallbacks with weights

def _legacy_weights(rows: np.ndarray, qw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks (32, B), weights (32, B)) for quantize_row_q{4_0,5_0,5_1}_impl: sigma2 over the whole row."""
    n = rows.shape[1]
    rt = np.ascontiguousarray(rows.T)
    sigma2 = running_sum(rt * rt) / F(n)
    xs = subblocks(rows, 32)
    w = subblocks(np.broadcast_to(qw, rows.shape), 32) * np.sqrt(np.repeat(sigma2, n // 32) + xs * xs)
    return xs, w


def _nibbles(L: np.ndarray) -> np.ndarray:
    """(32, B) codes as (B, 16): qs[j] = (L[j] & 15) | (L[j + 16] & 15) << 4."""
    L = np.ascontiguousarray(L.T).astype(np.uint8)
    return (L[:, :16] & 0xF) | ((L[:, 16:] & 0xF) << 4)


def _fifth_bits(L: np.ndarray) -> np.ndarray:
    bits = (np.ascontiguousarray(L.T).astype(np.uint32) >> 4) & 1
    qh = (bits << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return qh.astype("<u4").reshape(-1, 1).view(np.uint8)


def round_away(v: np.ndarray) -> np.ndarray:
    """C roundf (half away from zero); x - trunc(x) is exact in float32."""
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= F(0.5), np.sign(v), F(0))


def legacy_ref(rows: np.ndarray, qtype: str) -> np.ndarray:
    """quantize_row_{q4_0,q5_0,q5_1,q8_0}_ref. (gguf's numpy quantizer rounds ties to even where the C
    truncates x + 8.5f or rounds half away from zero, so it differs on a few blocks.)"""
    xs = subblocks(rows, 32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if qtype == "Q8_0":
            d = np.abs(xs).max(axis=0) / F(127)
            q = round_away(xs * np.where(d != 0, F(1) / d, F(0))).astype(np.int32)
            return np.concatenate([to_fp16(d).reshape(-1, 1).view(np.uint8),
                                   np.ascontiguousarray(q.T).astype(np.int8).view(np.uint8)], axis=1)
        if qtype == "Q5_1":
            mn = first_min(xs)
            d = (first_maxval(xs) - mn) / F(31)
            L = np.trunc((xs - mn) * np.where(d != 0, F(1) / d, F(0)) + F(0.5)).astype(np.int32) & 0xFF
            head = [to_fp16(d).reshape(-1, 1).view(np.uint8), to_fp16(mn).reshape(-1, 1).view(np.uint8)]
            return np.concatenate(head + [_fifth_bits(L), _nibbles(L)], axis=1)
        nmax = 8 if qtype == "Q4_0" else 16
        _, xmax = first_absmax(xs)
        d = xmax / F(-nmax)
        x0 = xs * np.where(d != 0, F(1) / d, F(0)) + F(nmax + 0.5)
        L = np.minimum(2 * nmax - 1, np.trunc(x0).astype(np.int32))
    head = [to_fp16(d).reshape(-1, 1).view(np.uint8)]
    if qtype == "Q4_0":
        return np.concatenate(head + [_nibbles(L)], axis=1)
    return np.concatenate(head + [_fifth_bits(L), _nibbles(L)], axis=1)


def legacy_weighted(rows: np.ndarray, qtype: str, qw: np.ndarray) -> np.ndarray:
    xs, w = _legacy_weights(rows, qw)
    if qtype == "Q5_1":
        scale, the_min, L = make_qkx(xs, w, 31, -0.9, 0.05, 36, False)
        head = [to_fp16(scale).reshape(-1, 1).view(np.uint8), to_fp16(-the_min).reshape(-1, 1).view(np.uint8)]
        return np.concatenate(head + [_fifth_bits(L), _nibbles(L)], axis=1)
    scale, L = make_qx(xs, 8 if qtype == "Q4_0" else 16, w)
    head = [to_fp16(scale).reshape(-1, 1).view(np.uint8)]
    if qtype == "Q4_0":
        return np.concatenate(head + [_nibbles(L)], axis=1)
    return np.concatenate(head + [_fifth_bits(L), _nibbles(L)], axis=1)


# --------------------------------------------------------------------------- entry point

K_QUANTIZERS = {"Q2_K": q2_k, "Q3_K": q3_k, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}


def row_bytes(qtype: str, n_per_row: int) -> int:
    block, size = BLOCK[qtype]
    return n_per_row // block * size


def quantize(rows: np.ndarray, qtype: str, quant_weights: np.ndarray | None = None) -> np.ndarray:
    """`rows` [..., n_per_row] float32 as ggml's quantize_<qtype>(rows, quant_weights) writes them:
    uint8 [..., row_bytes]. `quant_weights` [n_per_row] (one importance per column) or None."""
    rows = np.asarray(rows, dtype=F)
    shape, n = rows.shape, rows.shape[-1]
    block = BLOCK[qtype][0]
    if n % block:
        raise ValueError(f"{qtype}: a row of {n} values is not a whole number of {block}-value blocks")
    flat = rows.reshape(-1, n)
    qw = None
    if quant_weights is not None and qtype != "Q8_0":          # quantize_q8_0 ignores them
        qw = np.asarray(quant_weights, dtype=F).reshape(n)
    out = np.empty((flat.shape[0], row_bytes(qtype, n)), np.uint8)
    step = max(1, CHUNK // n)

    def one(start: int) -> None:
        chunk = np.ascontiguousarray(flat[start:start + step])
        out[start:start + step] = _quantize_chunk(chunk, qtype, qw).reshape(len(chunk), -1)

    starts = range(0, flat.shape[0], step)
    if THREADS > 1 and len(starts) > 1:
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(one, starts))
    else:
        for start in starts:
            one(start)
    return out.reshape(*shape[:-1], out.shape[-1])


def _quantize_chunk(chunk: np.ndarray, qtype: str, qw: np.ndarray | None) -> np.ndarray:
    if qtype in K_QUANTIZERS:
        X = chunk.reshape(-1, QK_K)
        W = None if qw is None else np.ascontiguousarray(np.broadcast_to(qw, chunk.shape)).reshape(-1, QK_K)
        return K_QUANTIZERS[qtype](X, W)
    if qw is not None:
        return legacy_weighted(chunk, qtype, qw)
    return legacy_ref(chunk, qtype)
