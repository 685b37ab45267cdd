"""Distillation's divergences between the student's and the teacher's next-token distributions (ArrayOps).

Written once for every backend: the backend hands each chunk of loss positions over as log-probabilities
(`BackendProtocol.token_divergence`: both models' logits / temperature, log-softmaxed, or with top_k the
teacher's k likeliest tokens and one tail bucket), and this gives the divergence's term for every position
and token; the backend sums them, over the vocabulary first (a float32 sum of millions of terms of both
signs in one pass loses digits on MLX: 0.7% of a JSD over a 49k vocabulary, measured). The
definitions are TRL 1.16's (`DistillationTrainer`'s chunked divergence, GKD's `generalized_jsd_loss`),
checked against them in tests/training/test_distill_oracle.py:

- beta 0, forward KL: KL(teacher || student) = sum_v p_t (log p_t - log p_s);
- beta 1, reverse KL: KL(student || teacher) = sum_v p_s (log p_s - log p_t);
- 0 < beta < 1, the generalized Jensen-Shannon divergence with mixture m = (1 - beta) p_s + beta p_t:
  beta KL(teacher || m) + (1 - beta) KL(student || m).

The mixture's log is log-sum-exp of the two weighted terms, written with the elementwise operations every
ArrayOps has: max(a, b) + log(exp(a - max) + exp(b - max)).
"""

from __future__ import annotations

import math


def divergence_terms(ops, student_logp, teacher_logp, beta: float):
    """[n, V] terms whose sum over a row is the divergence at that position, from two [n, V] log-prob arrays;
    gradient flows through the student's, the teacher's is a constant."""
    if beta == 0.0:
        return ops.exp(teacher_logp) * (teacher_logp - student_logp)
    if beta == 1.0:
        return ops.exp(student_logp) * (student_logp - teacher_logp)
    a = student_logp + math.log1p(-beta)
    b = teacher_logp + math.log(beta)
    top = -ops.minimum(-a, -b)                    # elementwise max, from the operations ArrayOps has
    mixture = top + ops.log(ops.exp(a - top) + ops.exp(b - top))
    return (beta * ops.exp(teacher_logp) * (teacher_logp - mixture)
            + (1.0 - beta) * ops.exp(student_logp) * (student_logp - mixture))


class Divergence:
    """The callable a backend's token_divergence sums chunk by chunk: (student, teacher log-probs) -> terms."""

    def __init__(self, ops, beta: float):
        self.ops, self.beta = ops, beta

    def __call__(self, student_logp, teacher_logp):
        return divergence_terms(self.ops, student_logp, teacher_logp, self.beta)
