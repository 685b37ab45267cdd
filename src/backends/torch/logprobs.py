"""Per-sequence log-probabilities and scalar-head scores on torch: what objectives consume.

Log-probs use SFT's masking (labels != -100) and its memory trick: only the
positions with a target go through the output head, in chunks; the head is
the model's own, with whatever its forward applies after it (model/heads.py). The
reference is the same weights with the PEFT adapter switched off, so DPO
needs no second copy of the model.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from .model.experts import adds_router_aux_loss, batch_router_aux_loss
from .handle import IGNORE_INDEX, LOSS_CHUNK_TOKENS, unwrap
from .model.heads import head_inputs


def sequence_logprobs(backend, handle, batch, grad: bool = True, router_aux: bool = False):
    """(summed log p(target) per row [B], float32, on the device; targets per row [B]); with
    `router_aux` a third item, the router's weighted load-balancing loss of this forward (a
    scalar; zero for a model that does not add one: routing.py).

    Without `grad` the model runs in eval mode (no dropout) and keeps no graph."""
    inputs, labels = backend._tensors(batch, handle.model)
    base = unwrap(handle.model)
    inputs, record = router_logits_asked(base, inputs, router_aux)
    counts = (np.asarray(batch.labels) != IGNORE_INDEX).sum(axis=1)
    with grad_mode(handle.model, grad), backend._autocast(handle):
        keep = labels != IGNORE_INDEX
        rows = keep.nonzero()[:, 0]              # the row of each kept position, row-major
        picked, head = head_inputs(base, base.get_decoder(), inputs, keep, record)
        targets = labels[keep]
        pieces = []
        for start in range(0, targets.numel(), LOSS_CHUNK_TOKENS):
            logits = head(picked[start : start + LOSS_CHUNK_TOKENS])
            pieces.append(-F.cross_entropy(logits, targets[start : start + LOSS_CHUNK_TOKENS], reduction="none"))
        sums = picked.new_zeros(labels.shape[0], dtype=torch.float32)
        if pieces:
            sums = sums.index_add(0, rows, torch.cat(pieces))
        elif grad:
            sums = sums + 0.0 * picked.sum()     # keep the graph: backward() needs a path to the weights
        if router_aux:
            return sums, counts, aux_term(backend, base, record, batch)
    return sums, counts


def router_logits_asked(base, inputs: dict, router_aux: bool) -> tuple[dict, dict | None]:
    """The forward's inputs, asking for router logits where the model adds their loss; and the
    record head_inputs keeps the outputs in (None when nothing is asked)."""
    if router_aux and adds_router_aux_loss(base):
        return {**inputs, "output_router_logits": True}, {}
    return inputs, None


def aux_term(backend, base, record: dict | None, batch) -> torch.Tensor:
    """The weighted load-balancing loss of the forward `record` kept, or a zero scalar."""
    if record is None:
        return torch.zeros((), dtype=torch.float32, device=backend.plan.device)
    return batch_router_aux_loss(base, record.get("outputs"), batch, backend.plan.device)


def token_logprobs(backend, handle, batch, grad: bool = True, temperature: float = 1.0,
                   reference: bool = False, entropy: bool = False, router_aux: bool = False):
    """log p(target) [N] at each position with a label (row-major), from logits / temperature, in
    float32; and with `entropy` the distribution's entropy there (numpy, a metric: no gradient);
    with `router_aux` a third item, as sequence_logprobs'.

    The output head runs a chunk of positions at a time. With gradient each chunk is
    checkpointed: its [chunk, vocab] logits are rebuilt in the backward instead of being
    kept, so a step holds one chunk of logits at a time, not [N, vocab] (2 GB in float32
    for 8 completions of 1024 tokens over a 64k vocabulary)."""
    if reference:
        with adapters_disabled(handle.model):
            return token_logprobs(backend, handle, batch, grad=False, temperature=temperature, entropy=entropy,
                                  router_aux=router_aux)
    inputs, labels = backend._tensors(batch, handle.model)
    base = unwrap(handle.model)
    inputs, record = router_logits_asked(base, inputs, router_aux)
    with grad_mode(handle.model, grad), backend._autocast(handle):
        keep = labels != IGNORE_INDEX
        picked, head = head_inputs(base, base.get_decoder(), inputs, keep, record)
        targets = labels[keep]
        logps, entropies = [], []
        for start in range(0, targets.numel(), LOSS_CHUNK_TOKENS):
            args = (head, picked[start : start + LOSS_CHUNK_TOKENS], targets[start : start + LOSS_CHUNK_TOKENS],
                    temperature, entropy)
            if grad:
                lp, ent = torch.utils.checkpoint.checkpoint(chunk_logprobs, *args, use_reentrant=False)
            else:
                lp, ent = chunk_logprobs(*args)
            logps.append(lp)
            entropies.append(ent)
    if not logps:
        empty = picked.new_zeros(0, dtype=torch.float32)
        out = (empty + 0.0 * picked.sum() if grad else empty), (np.zeros(0, np.float32) if entropy else None)
    else:
        out = torch.cat(logps), (torch.cat(entropies).cpu().numpy() if entropy else None)
    return (*out, aux_term(backend, base, record, batch)) if router_aux else out


def chunk_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool):
    logits = head(hidden)        # float32, the model's own logits (heads.OutputHead)
    if temperature != 1.0:
        logits = logits / temperature
    logp = logits.log_softmax(-1)
    picked = logp.gather(-1, targets[:, None])[:, 0]
    if not entropy:
        return picked, None
    with torch.no_grad():
        ent = -(logp.exp() * logp).sum(-1)
    return picked, ent


@torch.no_grad()
def reference_logprobs(backend, handle, batch) -> torch.Tensor:
    with adapters_disabled(handle.model):
        logps, _ = sequence_logprobs(backend, handle, batch, grad=False)
    return logps


@contextlib.contextmanager
def grad_mode(model, grad: bool):
    """With gradient: as the trainer left the model. Without: no graph, and eval mode for the
    duration (held-out numbers and baselines are measured without dropout)."""
    if grad:
        with torch.enable_grad():
            yield
        return
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(training)


def adapters_disabled(model):
    """PEFT's switch for the adapter layers; a model without an adapter is its own reference."""
    if hasattr(model, "disable_adapter") and hasattr(model, "peft_config"):
        return model.disable_adapter()
    return contextlib.nullcontext()


def sequence_scores(backend, handle, batch, grad: bool = True) -> torch.Tensor:
    """The sequence-classification head's score per row, read where transformers reads it."""
    dev = backend.plan.device
    with grad_mode(handle.model, grad), backend._autocast(handle):
        logits = handle.model(input_ids=torch.as_tensor(batch.input_ids, device=dev),
                              attention_mask=torch.as_tensor(batch.attention_mask, device=dev)).logits
    return logits[:, 0].float()


def token_scores(backend, handle, batch, grad: bool = True) -> torch.Tensor:
    """Token-classification logits [N, classes] where batch.labels != -100 (row-major)."""
    dev = backend.plan.device
    with grad_mode(handle.model, grad), backend._autocast(handle):
        logits = handle.model(input_ids=torch.as_tensor(batch.input_ids, device=dev),
                              attention_mask=torch.as_tensor(batch.attention_mask, device=dev)).logits
    keep = torch.as_tensor(np.asarray(batch.labels) != IGNORE_INDEX, device=dev)
    return logits[keep].float()
