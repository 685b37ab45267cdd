"""`--imatrix auto`: an importance matrix from the run's own training data, as llama-imatrix would
collect it from a text file, through the merged model the GGUF is written from.

The run's training examples are tokenized as the run tokenized them (data.prepare_data, its cache
reused), their tokens laid end to end in the run's order and cut into chunks of CHUNK tokens, each
run alone (llama-imatrix's `-c 512`), until TOKENS tokens: the statistics are per-column means, so
a sample of the data serves as the whole does, in seconds on a small model. The matrix is written
beside the GGUF (imatrix.gguf, llama-imatrix's GGUF form), so llama-quantize can reuse it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import MudpuppyError
from .imatrix import quant_weights, stats_for_model, write_imatrix

CHUNK = 512            # llama-imatrix's default context: each chunk is one forward pass
TOKENS = 64 * 1024     # 128 chunks


def calibration_chunks(train, chunk: int = CHUNK, tokens: int = TOKENS) -> list[list[int]]:
    """The first `tokens` tokens of the training examples, end to end in order, in chunks of `chunk` (the
    last one shorter where the data runs out). Of a preference pair, its chosen sequence."""
    taken: list[np.ndarray] = []
    have = 0
    for example in train:
        ids = np.asarray(example.sequences()[0].input_ids, dtype=np.int64)[: tokens - have]
        taken.append(ids)
        have += len(ids)
        if have >= tokens:
            break
    flat = np.concatenate(taken) if taken else np.zeros(0, np.int64)
    return [flat[i:i + chunk].tolist() for i in range(0, len(flat), chunk)]


def collect_from_run(src, tokenizer, model_dir: Path, backend, out: Path, echo, handle=None) -> dict[str, np.ndarray]:
    """`quant_weights` for write_gguf, collected with `backend` from the run's (`src`, a run source) data
    over `model_dir` (the merged plain model; `handle`, the backend's float32 handle on it where the merge
    left one loaded); the matrix itself is written to `out`."""
    import json

    from ..data import prepare_data

    cfg = src.cfg
    prepared = prepare_data(cfg, tokenizer)
    chunks = calibration_chunks(prepared.train)
    if not chunks:
        raise MudpuppyError(f"--imatrix auto: the run's training data ({src.given}/config.yaml) has no tokens")
    echo(f"importance matrix: {sum(map(len, chunks)):,} tokens of the run's training data in {len(chunks)} "
         f"chunks of up to {CHUNK}")
    if handle is None:
        model_cfg = cfg.model.model_copy(update={"base_model": str(model_dir), "tokenizer": str(model_dir),
                                                 "revision": None})
        handle = backend.load_model(model_cfg, "fp32")
    sums = backend.input_squares(handle, chunks)
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    stats = stats_for_model(sums, config, str(model_dir))
    datasets = [str(d.path) for d in cfg.data.datasets] if getattr(cfg.data, "datasets", None) else []
    write_imatrix(out, stats, datasets, chunk_count=len(chunks), chunk_size=CHUNK)
    return quant_weights(stats)
