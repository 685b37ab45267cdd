"""LoRA initialisations that move part of each base weight into the adapter (PiSSA, OLoRA), and LoftQ's
start on a 4-bit base (`loftq_factors`, alternating: `loftq_iterated`), in numpy.

PEFT computes them on torch (`LoraLayer.pissa_init`, `olora_init`); the MLX backend computes the same
factors here from the same base weights, so both runtimes start from the same A, B and residual base
``W - scale * B @ A``. A singular vector (or a QR column) is defined up to its sign, and two LAPACK
builds may pick different ones, so each rank-one component is given one sign (`canonical_signs`) on
both runtimes: B @ A, the residual and the subspace are unchanged.

Such an adapter is only meaningful against its residual base. Saved, it becomes a plain LoRA against
the original base, as PEFT's ``path_initial_model_for_weight_conversion`` does
(`LoraModel.subtract_mutated_init`): W_res + s*B'A' = W + s*(B'A' - B0A0) = W + s*[B' | -B0][A'; A0],
a LoRA of rank 2r whose scale is kept by doubling alpha (rsLoRA: times sqrt 2). Every reader of a plain
LoRA (merge, GGUF, Ollama, mlx-lm, PEFT) then takes it on the base it names.
"""

from __future__ import annotations

import numpy as np

from .neutral import Adapter, ModuleAdapter
from .tensors import AdapterError, RawTensor

MUTATING = ("pissa", "olora")   # initialisations that replace the base weight by a residual


def mutates_base(init: str) -> bool:
    """Whether `init` (adapter.init) moves part of the base weight into the adapter."""
    return init.startswith(MUTATING)


def peft_init(init: str):
    """adapter.init as PEFT's LoraConfig.init_lora_weights."""
    return True if init == "default" else init


def niter_of(init: str) -> int | None:
    """N of pissa_niter_N; None for the exact SVD."""
    return int(init.rsplit("_", 1)[1]) if init.startswith("pissa_niter_") else None


def initial_factors(init: str, weight: np.ndarray, r: int, scale: float, seed: int = 0) -> tuple[np.ndarray, ...]:
    """(A [r, in], B [out, r], residual [out, in]) for a base weight [out, in], computed in float32 as PEFT
    does; signs canonical. pissa_niter_N draws its random projection from `seed` (PEFT draws from torch's
    generator, so only the exact pissa and olora agree with torch's to rounding)."""
    w = np.asarray(weight, dtype=np.float32)
    if init == "olora":
        q, rr = np.linalg.qr(w)
        a, b = rr[:r], q[:, :r]
    elif init.startswith("pissa"):
        niter = niter_of(init)
        a, b = split_singular(np.linalg.svd(w, full_matrices=False) if niter is None
                              else randomized_svd(w, r, niter, np.random.default_rng(seed)), r, scale)
    else:
        raise AdapterError(f"adapter.init {init!r} keeps the base weight; it has no initial factors")
    a, b = canonical_signs(np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32))
    return a, b, w - np.float32(scale) * (b @ a)


def split_singular(svd, r: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) from (U, S, Vh): the top r triplets split as PEFT splits them (B = U sqrt(S), A = sqrt(S) Vh),
    each divided by sqrt(scale) so that scale * B @ A is the rank-r truncation itself."""
    u, s, vh = svd
    root = np.sqrt(s[:r] / scale)
    return root[:, None] * vh[:r], u[:, :r] * root[None, :]


def loftq_factors(weight: np.ndarray, dequantized: np.ndarray, r: int, scale: float) -> tuple[np.ndarray, ...]:
    """LoftQ's start on an unchanged 4-bit base (PEFT's `_loftq_init_new`): (A [r, in], B [out, r]) with
    scale * B @ A the rank-r SVD of the quantization error W - dequantize(quantize(W)), signs canonical.
    PEFT sets A, B = sqrt(S) Vh, U sqrt(S) without dividing by the LoRA scale, so its correction is
    scale * E_r; here it is E_r whatever alpha and r are (equal to PEFT's at scale 1)."""
    error = np.asarray(weight, dtype=np.float32) - np.asarray(dequantized, dtype=np.float32)
    a, b = split_singular(np.linalg.svd(error, full_matrices=False), r, scale)
    return canonical_signs(np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32))


def loftq_iterated(weight: np.ndarray, dequantized: np.ndarray, requantize, r: int, scale: float,
                   iters: int) -> tuple[np.ndarray, ...]:
    """LoftQ's alternating start (PEFT's `loftq_init`, `num_iter` = iters): the loaded base `dequantized`
    is Q(W); each further iteration quantizes again W minus the rank-r SVD of the last error
    (`requantize(x)` sets the runtime's 4-bit base to Q(x) and returns its dequantized value), and A, B
    are `loftq_factors` of the last base. One iteration is `loftq_factors` itself, the base unchanged."""
    weight = np.asarray(weight, dtype=np.float32)
    dequantized = np.asarray(dequantized, dtype=np.float32)
    for _ in range(iters - 1):
        u, s, vh = np.linalg.svd(weight - dequantized, full_matrices=False)
        dequantized = np.asarray(requantize(weight - (u[:, :r] * s[:r]) @ vh[:r]), dtype=np.float32)
    return loftq_factors(weight, dequantized, r, scale)


def randomized_svd(w: np.ndarray, q: int, niter: int, rng: np.random.Generator):
    """torch.svd_lowrank's algorithm (Halko et al. 2009, 4.4): a q-column range found by `niter` power
    iterations, then the exact SVD of the projected matrix."""
    basis = np.linalg.qr(w @ rng.standard_normal((w.shape[1], q)).astype(np.float32))[0]
    for _ in range(niter):
        basis = np.linalg.qr(w.T @ basis)[0]
        basis = np.linalg.qr(w @ basis)[0]
    u, s, vh = np.linalg.svd(basis.T @ w, full_matrices=False)
    return basis @ u, s, vh


def canonical_signs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each component k of B @ A with B[:, k]'s largest-magnitude entry positive (B @ A unchanged)."""
    rows = np.abs(b).argmax(axis=0)
    signs = np.where(b[rows, np.arange(b.shape[1])] < 0, -1.0, 1.0).astype(b.dtype)
    return a * signs[:, None], b * signs[None, :]


def as_plain_lora(adapter: Adapter, initial: dict[str, tuple[np.ndarray, np.ndarray]]) -> Adapter:
    """The trained adapter (on the residual base) as a plain LoRA of rank 2r on the original base.

    `initial` maps each module path to its starting (A0, B0); A' = [A; A0], B' = [B | -B0], stored in the
    trained tensors' dtype (A0 and B0 were that dtype's values when training began)."""
    if set(initial) != set(adapter.modules) or adapter.experts:
        raise AdapterError(f"the adapter's modules ({len(adapter.modules)}) are not those its initialisation set "
                           f"({len(initial)}), or it adapts fused experts; it cannot be written as a plain LoRA")
    modules = {}
    for path, mod in adapter.modules.items():
        a0, b0 = initial[path]
        a = np.concatenate([mod.lora_a.array.astype(np.float32), a0], axis=0)
        b = np.concatenate([mod.lora_b.array.astype(np.float32), -b0], axis=1)
        modules[path] = ModuleAdapter(RawTensor("F32", a), RawTensor("F32", b))
    alpha = adapter.alpha * (2 ** 0.5 if adapter.rslora else 2)
    config = dict(adapter.peft_config or {})
    if config:
        config.update(r=2 * adapter.r, lora_alpha=alpha, init_lora_weights=True)
    return Adapter(kind=adapter.kind, r=2 * adapter.r, alpha=alpha, modules=modules, rslora=adapter.rslora,
                   dropout=adapter.dropout, base_model=adapter.base_model, peft_config=config or None,
                   num_layers=adapter.num_layers, target_modules=adapter.target_modules, extra=adapter.extra,
                   task_type=adapter.task_type, full=adapter.full)


def rewrite_as_plain_lora(path, initial: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """The PEFT adapter just saved at `path` (trained on the residual base) rewritten in place as the plain
    LoRA of `as_plain_lora`: what PEFT's save_pretrained writes given path_initial_model_for_weight_conversion."""
    from .convert import read_adapter
    from .peft_format import write_peft

    write_peft(as_plain_lora(read_adapter(path), initial), path)
