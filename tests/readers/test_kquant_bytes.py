"""Every K-quant file type mudpuppy writes equals, byte for byte, what llama.cpp's own quantizer
(llama_model_quantize, the function llama-quantize calls) writes from the f32 GGUF of the same model:
the same tensors, each of the same ggml type with the same bytes. Without an importance matrix for
every family, and with one (an imatrix GGUF in llama-imatrix's form, read by mudpuppy through
--imatrix and handed to llama.cpp as llama-quantize's load_imatrix would) for a dense model, an MoE
model (per-expert rows) and a tied head (the head's row filed under token_embd); and the 32-value
fallback types of rows that are not a multiple of 256 (a 96-wide model), at every K file type."""

from __future__ import annotations

import numpy as np
import pytest

from mudpuppy.export.imatrix import Stats, write_imatrix

from .conftest import ALL_FAMILIES
from .cpp import K_QUANTS, READERS, quantize

pytestmark = READERS
IMATRIX_FAMILIES = ["qwen3", "qwen3moe", "gemma3"]


def differences(ours, theirs) -> list[str]:
    """Each tensor that differs: name, types, and where its first differing block is."""
    import gguf

    a = {t.name: t for t in gguf.GGUFReader(str(ours)).tensors}
    b = {t.name: t for t in gguf.GGUFReader(str(theirs)).tensors}
    out = [f"only in mudpuppy's: {n}" for n in sorted(set(a) - set(b))]
    out += [f"only in llama.cpp's: {n}" for n in sorted(set(b) - set(a))]
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        if x.tensor_type != y.tensor_type:
            out.append(f"{name}: {x.tensor_type.name} here, {y.tensor_type.name} in llama.cpp's")
            continue
        bx, by = np.asarray(x.data).view(np.uint8).reshape(-1), np.asarray(y.data).view(np.uint8).reshape(-1)
        if bx.shape != by.shape or not np.array_equal(bx, by):
            block = gguf.GGML_QUANT_SIZES[x.tensor_type][1]
            first = int(np.flatnonzero(bx != by)[0]) if bx.shape == by.shape else 0
            n_bad = int((bx.reshape(-1, block) != by.reshape(-1, block)).any(axis=1).sum()) \
                if bx.shape == by.shape else -1
            out.append(f"{name} ({x.tensor_type.name}): {n_bad} of {bx.size // block} blocks differ, "
                       f"first at block {first // block}")
    return out


@pytest.mark.parametrize("quant", K_QUANTS + ["q4_0"])      # q4_0: its output Q6_K by the same rules
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_k_quant_file_equals_llama_cpp_quantizer(models, family, quant, tmp_path):
    ours = models.gguf(family, quant)
    theirs = tmp_path / f"llama-{quant}.gguf"
    quantize(models.gguf(family, "f32"), theirs, quant)
    import gguf

    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(ours)).tensors}
    assert kinds & {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}, kinds     # K-quant blocks, not only fallbacks
    assert differences(ours, theirs) == []


def random_imatrix(f32_path, path, seed: int) -> dict[str, np.ndarray]:
    """An importance matrix for every matrix llama-quantize may quantize in `f32_path` (token_embd too, as
    llama-imatrix files a tied head's inputs), in llama-imatrix's
    GGUF form at `path` (some columns never reached: sum 0; one expert never routed to: count 0), and
    the weights llama-quantize's load_imatrix derives from it (tools/quantize/quantize.cpp:199-215:
    sum / count in float32, 1 for a matrix with count 0)."""
    import gguf

    rng = np.random.default_rng(seed)
    stats = {}
    for t in gguf.GGUFReader(str(f32_path)).tensors:
        shape = [int(n) for n in t.shape]                       # ggml order: cols, rows[, experts]
        if len(shape) < 2 or "norm" in t.name or "ffn_gate_inp" in t.name:
            continue
        n_mat = shape[2] if len(shape) == 3 else 1
        sums = (rng.random((n_mat, shape[0])) ** 3 * 50).astype(np.float64)
        sums[:, rng.random(shape[0]) < 0.05] = 0.0
        counts = rng.integers(1, 4000, n_mat).astype(np.int64)
        if n_mat > 1:
            counts[-1] = 0
        stats[t.name] = Stats(sums, counts)
    write_imatrix(path, stats, ["random"], chunk_count=3, chunk_size=512)
    weights = {}
    for name, s in stats.items():
        sums32 = s.sums.astype(np.float32)
        w = np.ones_like(sums32)
        for j, count in enumerate(s.counts):
            if count > 0:
                w[j] = sums32[j] / np.float32(count)
        weights[name] = w.reshape(-1)
    return weights


@pytest.mark.parametrize("quant", K_QUANTS)
@pytest.mark.parametrize("family", IMATRIX_FAMILIES)
def test_k_quant_file_with_an_imatrix_equals_llama_cpp_quantizer(models, family, quant, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"imatrix-{family}-{quant}")
    f32 = models.gguf(family, "f32")
    weights = random_imatrix(f32, root / "imatrix.gguf", seed=IMATRIX_FAMILIES.index(family))
    ours = models.gguf(family, quant, imatrix=root / "imatrix.gguf")
    theirs = root / f"llama-{quant}.gguf"
    quantize(f32, theirs, quant, weights)
    assert differences(ours, theirs) == []
    plain = models.gguf(family, quant)
    assert differences(ours, plain) != []                       # the matrix changed blocks: not vacuous


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """A Qwen3 model 96 wide with an FFN of 160 (rows multiples of 32, not of 256: each K type falls back
    to its 32-value type, as SmolLM2-135M's 576 do) and 512-wide attention outputs (4 heads of 128: K-quants
    stay), so one file holds both; its f32 GGUF and an export per quant, cached."""
    from mudpuppy.export import ExportRequest, export_model

    from ..export.test_gguf_families import build
    from .conftest import QUIET

    root = tmp_path_factory.mktemp("narrow")
    build("qwen3", root / "model", hidden_size=96, intermediate_size=160, num_hidden_layers=4)
    files = {}

    def gguf(quant: str):
        if quant not in files:
            export_model(ExportRequest(str(root / "model"), "gguf", str(root / quant), quant=quant), **QUIET)
            files[quant] = root / quant / f"model-{quant}.gguf"
        return files[quant]
    return gguf


@pytest.mark.parametrize("quant", K_QUANTS)
def test_fallback_types_equal_llama_cpp_quantizer(narrow, quant, tmp_path):
    import gguf

    ours, theirs = narrow(quant), tmp_path / f"llama-{quant}.gguf"
    quantize(narrow("f32"), theirs, quant)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(ours)).tensors}
    assert kinds & {"Q4_0", "Q5_0", "Q5_1", "Q8_0"} and kinds & {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}, kinds
    assert differences(ours, theirs) == []
