"""llama.cpp's scale searches for K-quants (ggml/src/ggml-quants.c), vectorized over blocks.

Every function takes its blocks element-first: an array of shape (n, B) holds B blocks of n values,
so that a loop over the n elements (the C loop) runs over contiguous rows and each step works on
all B blocks at once. The arithmetic is float32 in the C's order: a C sum `s += a*b*c` is a
sequential sum of ((a*b)*c) rounded at every step (`running_sum`), never numpy's pairwise sum;
int-to-float conversions, the constants (0.1f, 12582912.f) and the comparisons are the C's. That is
what makes the blocks byte-identical to llama.cpp's, golden fixtures included
(benchmarks/kquant_fixtures.py).

    make_qkx      make_qkx2_quants / make_qkx3_quants (scale and min, weighted search): Q2_K, Q4_K, Q5_K, Q5_1
    make_qx       make_qx_quants with rmse_type 1 (signed scale, weighted search): Q3_K, Q6_K, Q4_0, Q5_0
    make_q3       make_q3_quants with do_rmse (Q3_K without importance weights)
    make_qp       make_qp_quants (the super-block scales with importance weights)
"""

from __future__ import annotations

import numpy as np

F = np.float32
GROUP_MAX_EPS = F(1e-15)
_MAGIC = F(12582912.0)          # 1.5 * 2**23: adding it rounds to an integer in the mantissa


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int bit for bit: (bits(v + 12582912.f) & 0x7fffff) - 0x400000 (round half to
    even for |v| < 2**22, and the same garbage as the C beyond, where llama.cpp's assert is compiled out)."""
    with np.errstate(invalid="ignore", over="ignore"):
        bits = (np.asarray(v, dtype=F) + _MAGIC).view(np.int32)
    return (bits & 0x7FFFFF) - 0x400000


def running_sum(terms: np.ndarray) -> np.ndarray:
    """`float s = 0; for (i...) s += terms[i];` over the first axis, rounded at every step."""
    acc = np.zeros(terms.shape[1:], dtype=F)
    for row in terms:
        acc += row
    return acc


def sum_from_first(terms: np.ndarray) -> np.ndarray:
    """`float s = terms[0]; for (i = 1...) s += terms[i];` (the sums make_qkx starts from element 0)."""
    acc = terms[0].copy()
    for row in terms[1:]:
        acc += row
    return acc


def to_fp16(v: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16 (round to nearest even, as numpy's cast) as uint16 bit patterns."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(v, dtype=F).astype(np.float16).view(np.uint16)


def from_fp16(bits: np.ndarray) -> np.ndarray:
    return bits.view(np.float16).astype(F)


def first_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(max |x|, the x it came from) per block; the first of equal magnitudes, as `if (ax > amax)`."""
    ax = np.abs(x)
    idx = np.argmax(ax, axis=0)
    cols = np.arange(x.shape[1])
    amax = ax[idx, cols]
    return amax, np.where(amax > 0, x[idx, cols], F(0))   # all zeros: the C's `max = 0` stays +0


def first_min(x: np.ndarray) -> np.ndarray:
    """The minimum per block, the first of equal values (`if (x[i] < min)`): its sign, when it is a
    zero, reaches a stored fp16 min."""
    return x[np.argmin(x, axis=0), np.arange(x.shape[1])]


def first_maxval(x: np.ndarray) -> np.ndarray:
    """The maximum per block, the first of equal values (`if (x[i] > max)`)."""
    return x[np.argmax(x, axis=0), np.arange(x.shape[1])]


def _error(diff: np.ndarray, use_mad: bool) -> np.ndarray:
    return np.abs(diff) if use_mad else diff * diff


def make_qkx(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
             use_mad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scale, the_min, L) as make_qkx2_quants (make_qkx3_quants is the same with weights given):
    codes L in [0, nmax] with x ~ scale * L - the_min; a grid of nstep + 1 inverse scales, each fitted
    by weighted least squares, kept where the weighted error drops."""
    mn = first_min(x)
    mn = np.where(mn > 0, F(0), mn)
    mx = first_maxval(x)
    sum_w = sum_from_first(w)
    sum_x = sum_from_first(w * x)
    flat = mx == mn
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F(nmax) / (mx - mn)
        scale = F(1) / iscale
        L = np.clip(nearest_int(iscale * (x - mn)), 0, nmax)
        best = running_sum(w * _error(scale * L.astype(F) + mn - x, use_mad))
        for step in range(nstep + 1):
            iscale = (F(rmin) + F(rdelta) * F(step) + F(nmax)) / (mx - mn)
            laux = np.clip(nearest_int(iscale * (x - mn)), 0, nmax)
            lf = laux.astype(F)
            wl = w * lf
            sum_l, sum_l2, sum_xl = running_sum(wl), running_sum(wl * lf), running_sum(wl * x)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            positive = this_min > 0
            this_min = np.where(positive, F(0), this_min)
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            cur = running_sum(w * _error(this_scale * lf + this_min - x, use_mad))
            better = (D > 0) & (cur < best) & ~flat
            L = np.where(better, laux, L)
            best = np.where(better, cur, best)
            scale = np.where(better, this_scale, scale)
            mn = np.where(better, this_min, mn)
    L = np.where(flat, 0, L)
    scale = np.where(flat, F(0), scale)
    return scale, -mn, L


def make_qx(x: np.ndarray, nmax: int, w: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(scale, L) as make_qx_quants(n, nmax, x, L, rmse_type=1, qw): codes L = l + nmax with l in
    [-nmax, nmax - 1], x ~ scale * l; 19 inverse scales around -nmax / max, the best weighted fit kept.
    Without `w` the weights are x * x."""
    amax, xmax = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    if w is None:
        w = x * x
    wx = w * x

    def fit(iscale):
        l = np.clip(nearest_int(iscale * x), -nmax, nmax - 1)
        lf = l.astype(F)
        return l, running_sum(wx * lf), running_sum(w * lf * lf)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        l, sumlx, suml2 = fit(F(-nmax) / xmax)
        L = l + nmax
        scale = np.where(suml2 != 0, sumlx / suml2, F(0))
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            l, sumlx, suml2 = fit(-(F(nmax) + F(0.1) * F(step)) / xmax)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            L = np.where(better, l + nmax, L)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    return np.where(zero, F(0), scale), np.where(zero, 0, L)


def _greedy(x, w, L, sumlx, suml2, lo: int, hi: int, both_positive: bool):
    """The coordinate passes of make_q3_quants / make_qp_quants: each code in turn moved to the
    value the others' fit asks for, kept when it raises sumlx^2 / suml2; five passes (a pass that
    changes nothing leaves the next one nothing to change, so the C's early exit needs no mirror)."""
    wx = w * x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for _ in range(5):
            for i in range(x.shape[0]):
                li = L[i].astype(F)
                slx = sumlx - wx[i] * li
                sl2 = suml2 - w[i] * li * li
                active = (slx > 0) & (sl2 > 0) if both_positive else slx > 0
                new = np.clip(nearest_int(x[i] * sl2 / slx), lo, hi)
                nf = new.astype(F)
                slx = slx + wx[i] * nf
                sl2 = sl2 + w[i] * nf * nf
                take = active & (new != L[i]) & (slx * slx * suml2 > sumlx * sumlx * sl2)
                if not both_positive:
                    take &= sl2 > 0
                L[i] = np.where(take, new & 0xFF if both_positive else new, L[i])
                sumlx = np.where(take, slx, sumlx)
                suml2 = np.where(take, sl2, suml2)
    return L, sumlx, suml2


def make_q3(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale, L) as make_q3_quants(n, nmax, x, L, do_rmse=true): weights x * x, greedy refinement."""
    amax, xmax = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    w = x * x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        L = np.clip(nearest_int(F(-nmax) / xmax * x), -nmax, nmax - 1)
        lf = L.astype(F)
        sumlx = running_sum(w * x * lf)
        suml2 = running_sum(w * lf * lf)
        L, sumlx, suml2 = _greedy(x, w, L, sumlx, suml2, -nmax, nmax - 1, both_positive=False)
        scale = np.where(suml2 > 0, sumlx / suml2, F(0))
    return np.where(zero, F(0), scale), np.where(zero, 0, L + nmax)


def make_qp(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale, L) as make_qp_quants: non-negative x (the sub-block scales or mins) on codes [0, nmax],
    weighted by `w` (the sub-blocks' summed importance). L is stored as uint8, as the C stores it."""
    mx = np.maximum(x.max(axis=0), F(0))
    zero = mx < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F(nmax) / mx
        Lq = nearest_int(iscale * x) & 0xFF
        scale = F(1) / iscale
        diff = x - scale * Lq.astype(F)
        best = running_sum(w * diff * diff)
        for step in range(-4, 5):
            if step == 0:
                continue
            iscale_is = (F(0.1) * F(step) + F(nmax)) / mx
            l = np.minimum(nmax, nearest_int(iscale_is * x))
            diff = x - (F(1) / iscale_is) * l.astype(F)
            mse = running_sum(w * diff * diff)
            better = mse < best
            best = np.where(better, mse, best)
            iscale = np.where(better, iscale_is, iscale)
        l = np.minimum(nmax, nearest_int(iscale * x))
        lf = l.astype(F)
        sumlx = running_sum(w * x * lf)
        suml2 = running_sum(w * lf * lf)
        L, sumlx, suml2 = _greedy(x, w, l & 0xFF, sumlx, suml2, -(2 ** 31), nmax, both_positive=True)
        scale = np.where(suml2 > 0, sumlx / suml2, F(0))
    return np.where(zero, F(0), scale), np.where(zero, 0, L)
