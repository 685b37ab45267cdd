"""Collecting an importance matrix: what llama.cpp's llama-imatrix records, from a torch model.

For every linear layer, the sum over all token rows of each input column's square, and the number
of rows (tools/imatrix/imatrix.cpp collect_imatrix: `acc[j] += x[j] * x[j]`, `counts += nrows`).
No padded position enters a sum: sequences of one length run together as one batch (no token attends
across the batch, so each row is what it is when its sequence runs alone, as llama-imatrix runs its
chunks), a sequence of another length in a batch of its own. The output head's input is recorded and
the forward stops there: the vocabulary-wide logits are never computed (a fifth of a small model's
work). The result is plain numpy keyed by module name; export/imatrix.py renames it to GGUF tensors
and writes or uses it.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

BATCH_TOKENS = 4096    # tokens per forward pass: eight of llama-imatrix's 512-token chunks


class _HeadReached(Exception):
    """Raised by the output head's hook once its input is recorded: nothing after it is needed."""


def batches(sequences: Iterable, max_tokens: int | None = None, batch_tokens: int = BATCH_TOKENS) -> list[list[list[int]]]:
    """`sequences` (cut off after `max_tokens` tokens in order) grouped into batches of equal-length
    sequences of at most `batch_tokens` tokens (a longer sequence alone)."""
    by_length: dict[int, list[list[int]]] = {}
    seen = 0
    for ids in sequences:
        ids = list(ids)
        if max_tokens is not None:
            ids = ids[: max_tokens - seen]
        if not ids:
            break
        by_length.setdefault(len(ids), []).append(ids)
        seen += len(ids)
    out = []
    for length, group in by_length.items():
        per = max(1, batch_tokens // length)
        out += [group[i:i + per] for i in range(0, len(group), per)]
    return out


def collect_input_squares(model, sequences: Iterable, max_tokens: int | None = None,
                          batch_tokens: int = BATCH_TOKENS) -> dict[str, tuple[np.ndarray, int]]:
    """{module name: (float64 [in_features] sum of x^2, rows)} over `sequences` (token id lists or 1-D
    arrays) run through `model` (a transformers causal LM), stopping after `max_tokens` tokens if given."""
    import torch

    sums: dict[str, torch.Tensor] = {}
    rows: dict[str, int] = {}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def hook(name, module):
        def record(_module, inputs):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(torch.float64)
            sums[name] = sums[name] + (x * x).sum(0) if name in sums else (x * x).sum(0)
            rows[name] = rows.get(name, 0) + x.shape[0]
            if module is head:
                raise _HeadReached
        return record

    handles = [m.register_forward_pre_hook(hook(n, m)) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for batch in batches(sequences, max_tokens, batch_tokens):
                try:
                    model(input_ids=torch.tensor(batch, device=device), use_cache=False)
                except _HeadReached:
                    pass
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {n: (sums[n].cpu().numpy(), rows[n]) for n in sums}
