"""Collecting an importance matrix: what llama.cpp's llama-imatrix records, from a torch model.

For every linear layer, the sum over all token rows of each input column's square, and the number
of rows (tools/imatrix/imatrix.cpp collect_imatrix: `acc[j] += x[j] * x[j]`, `counts += nrows`).
Sequences run one at a time without padding, as llama-imatrix runs its chunks, so no padded position
enters a sum. The result is plain numpy keyed by module name; export/imatrix.py renames it to GGUF
tensors and writes or uses it.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


def collect_input_squares(model, sequences: Iterable, max_tokens: int | None = None) -> dict[str, tuple[np.ndarray, int]]:
    """{module name: (float64 [in_features] sum of x^2, rows)} over `sequences` (token id lists or 1-D
    arrays) run through `model` (a transformers causal LM), stopping after `max_tokens` tokens if given."""
    import torch

    sums: dict[str, torch.Tensor] = {}
    rows: dict[str, int] = {}

    def hook(name):
        def record(_module, inputs):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(torch.float64)
            sums[name] = sums[name] + (x * x).sum(0) if name in sums else (x * x).sum(0)
            rows[name] = rows.get(name, 0) + x.shape[0]
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)]
    device = next(model.parameters()).device
    seen = 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for ids in sequences:
                ids = list(ids)
                if max_tokens is not None:
                    ids = ids[: max_tokens - seen]
                if not ids:
                    break
                model(input_ids=torch.tensor([ids], device=device))
                seen += len(ids)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {n: (sums[n].cpu().numpy(), rows[n]) for n in sums}
