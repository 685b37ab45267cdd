"""Distillation's per-token divergence on torch: student and teacher distributions at the loss positions,
a chunk of positions at a time (`BackendProtocol.token_divergence`).

Each model's decoder runs once over the batch (the teacher without gradient, in eval mode); only the
positions with a label go through the output heads (model/heads.py: each model's own head), CHUNK_TOKENS
rows at a time, so neither model's [N, vocab] logits exist at once. With gradient each chunk is
checkpointed as token_logprobs' are: the student's and the teacher's chunk logits are rebuilt in the
backward, not kept. The divergence itself is the caller's (training/distill_loss.py, written with ArrayOps).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from .handle import IGNORE_INDEX, unwrap
from .logprobs import grad_mode
from .model.heads import head_inputs

# Loss positions a chunk: a chunk holds about a dozen [rows, vocab] float32 arrays at once (both models' logits
# and log-probs, the divergence's terms, their gradients), 0.6 GB at 256 rows over a 49k vocabulary. Measured
# (vocab 49,152, 4,088 loss positions, JSD, forward and backward, CPU, peak RSS added): 0.83 GB at 256 rows, 3.1 GB
# at 1,024 (SFT's chunk), 13.2 GB for both models' full logits (GKD's loss on them).
CHUNK_TOKENS = 256


def token_divergence(backend, handle, teacher, batch, divergence, grad: bool = True, temperature: float = 1.0,
                     top_k: int = 0) -> torch.Tensor:
    """divergence(student log-probs, teacher log-probs), [chunk, V] terms, summed over the chunks of loss positions, a float32
    scalar (with gradient to the student's trainable weights when `grad`)."""
    inputs, labels = backend._tensors(batch, handle.model)
    keep = labels != IGNORE_INDEX
    t_inputs, _ = backend._tensors(batch, teacher.model)
    t_base = unwrap(teacher.model)
    with grad_mode(teacher.model, False), backend._autocast(teacher):
        t_rows, t_head = head_inputs(t_base, t_base.get_decoder(), t_inputs, keep)
    base = unwrap(handle.model)
    with grad_mode(handle.model, grad), backend._autocast(handle):
        s_rows, s_head = head_inputs(base, base.get_decoder(), inputs, keep)
        total = s_rows.new_zeros((), dtype=torch.float32)
        for start in range(0, max(int(keep.sum()), 1), CHUNK_TOKENS):
            span = slice(start, start + CHUNK_TOKENS)
            args = (s_head, t_head, s_rows[span], t_rows[span], divergence, temperature, top_k)
            if grad:
                total = total + torch.utils.checkpoint.checkpoint(chunk_divergence, *args, use_reentrant=False)
            else:
                total = total + chunk_divergence(*args)
    return total


def chunk_divergence(s_head, t_head, s_rows, t_rows, divergence, temperature: float, top_k: int):
    student = (s_head(s_rows) / temperature).log_softmax(-1)
    with torch.no_grad():
        teacher = (t_head(t_rows) / temperature).log_softmax(-1)
    if top_k:
        student, teacher = top_k_buckets(student, teacher, top_k)
    return divergence(student, teacher).sum(-1).sum()      # over the vocabulary first, then the positions


def top_k_buckets(student: torch.Tensor, teacher: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both distributions over the teacher's k likeliest tokens and one bucket holding the rest of the mass
    (TRL's server distillation: `_add_tail_bucket`)."""
    with torch.no_grad():
        index = teacher.topk(min(k, teacher.shape[-1]), dim=-1).indices
    return tail_bucket(student.gather(-1, index)), tail_bucket(teacher.gather(-1, index))


def tail_bucket(logp: torch.Tensor) -> torch.Tensor:
    """[n, k] log-probs with log(1 - their summed probability) appended: [n, k + 1]."""
    mass = torch.logsumexp(logp, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([logp, torch.log(-torch.expm1(mass))], dim=-1)
