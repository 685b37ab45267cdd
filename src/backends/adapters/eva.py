"""EVA (Paischer et al. 2024, PEFT's `init_lora_weights="eva"`) carried as one plain LoRA, in numpy.

PEFT's EVA sets each target layer's A to the top right-singular vectors of that layer's inputs over the
training data (B zero) and, with rank redistribution (rho > 1), gives layer i a rank r_i between 0 and
r * rho by explained variance, within a budget of r a layer; `adjust_scaling_factors` (its default) sets
alpha_i = alpha * r_i / r, so every layer keeps the scale alpha / r. PEFT saves that with a rank_pattern,
which mlx-lm, GGUF and the runtime-neutral format do not have. So mudpuppy attaches one LoRA of rank
R = max r_i with alpha * R / r (the same scale alpha / r everywhere) and pads each A_i with zero rows.
A padded component stays exactly zero through training: B starts at zero, so its column of B gets the
gradient of (zero row of A) . x = 0 and its row of A gets B's zero column times the output's gradient; with
AdamW or SGD a zero gradient is a zero update (and weight decay keeps zero at zero), so the model computes
and learns what PEFT's rank-r_i layers do. (Adafactor's update is scaled by RMS values over the whole
matrix, which the zeros change.)
"""

from __future__ import annotations

import numpy as np

from .tensors import AdapterError


def uniform_rank(components: dict[str, np.ndarray], r: int, alpha: float
                 ) -> tuple[int, float, dict[str, np.ndarray]]:
    """(R, alpha for rank R, each layer's A [R, in]) from EVA's components {layer: A_i [r_i, in]}."""
    if not components:
        raise AdapterError("EVA found no target layer to initialise")
    rank = max(1, max(a.shape[0] for a in components.values()))
    padded = {}
    for name, a in components.items():
        full = np.zeros((rank, a.shape[1]), dtype=np.float32)
        full[:a.shape[0]] = a
        padded[name] = full
    return rank, alpha * rank / r, padded


def eva_attached(adapter_cfg, rank: int, alpha: float):
    """The adapter config (config.AdapterConfig) that carries EVA's start: a plain LoRA of rank `rank` and
    `alpha`, its A set once attached."""
    return adapter_cfg.model_copy(update={"r": rank, "alpha": alpha, "init": "default", "eva_rho": None})


def eva_labels(labels: np.ndarray, ignore: int = -100) -> np.ndarray:
    """mudpuppy's labels (shifted: label t is the target of input t) as transformers' (label t is token t),
    the form PEFT's EVA masks by: the completion's tokens are the positions EVA decomposes."""
    out = np.full_like(labels, ignore)
    out[:, 1:] = labels[:, :-1]
    return out
