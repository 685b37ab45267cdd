"""llama.cpp through llama-cpp-python, for the readers tier (`make test-readers`, tests marked `readers`).

Every test that needs llama.cpp carries READERS: it runs under `pytest -m readers`, and where
llama-cpp-python is not importable it is skipped with the reason below (`make test-readers` checks
the import first and fails instead, so the tier never passes having run nothing).

    quantize(src, dst, quant, weights)   llama.cpp's own quantizer (llama_model_quantize, what
                                         llama-quantize calls) on a GGUF, with an importance matrix
                                         passed as llama-quantize passes it (llama_model_imatrix_data)
    load(path)                           a Llama with an f32 KV cache (greedy answers and logits
                                         without the f16 cache's rounding)
    greedy(llm, ids, n) / logits(llm, ids)
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import numpy as np
import pytest

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
REASON = ("llama-cpp-python is not installed: the readers tier needs it "
          "(`make test-readers` installs the `readers` extra; it compiles llama.cpp, docs/export.md#llamacpp-test-tier)")
READERS = [pytest.mark.readers, pytest.mark.skipif(not HAVE_LLAMA_CPP, reason=REASON)]

# mudpuppy's --quant -> llama_ftype (llama.h)
FTYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "q2_k": 10, "q3_k_s": 11, "q3_k_m": 12, "q3_k_l": 13,
          "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18}
K_QUANTS = ["q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k"]


def quantize(src: Path, dst: Path, quant: str, weights: dict[str, np.ndarray] | None = None) -> None:
    """`src` (an f32 GGUF) quantized to `quant` by llama.cpp. `weights`: GGUF tensor name -> the
    importance row(s) llama-quantize would hand over after load_imatrix (float32, n_mat * cols)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[quant]
    params.nthread = 2
    keep = []
    if weights is not None:
        entries = (llama_cpp.llama_model_imatrix_data * (len(weights) + 1))()
        for i, (name, row) in enumerate(sorted(weights.items())):
            row = np.ascontiguousarray(row, dtype=np.float32)
            keep.append(row)
            entries[i].name = name.encode()
            entries[i].data = row.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = row.size
        entries[len(weights)].name = None                 # the list ends at a null name
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        keep.append(entries)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize({src} -> {quant}) returned {rc}"


def load(path: Path, n_ctx: int = 256):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, type_k=0, type_v=0,
                           n_threads=2, n_threads_batch=2, verbose=False)        # GGML_TYPE_F32 cache


def greedy(llm, ids: list[int], n: int) -> list[int]:
    got = []
    for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        got.append(int(token))
        if len(got) == n:
            break
    return got


def logits(llm, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits at every position of `ids`, [len(ids), vocab]."""
    llm.reset()
    llm.eval(ids)
    return np.asarray(llm.scores[:len(ids)], dtype=np.float32).copy()
