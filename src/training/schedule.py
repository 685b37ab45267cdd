"""Learning-rate schedules as plain functions of the step: identical on every backend."""

from __future__ import annotations

import math


def warmup_steps_for(cfg, total_steps: int) -> int:
    if cfg.warmup_steps:
        return min(cfg.warmup_steps, total_steps)
    return int(cfg.warmup_ratio * total_steps)


def learning_rate(cfg, step: int, total_steps: int) -> float:
    """LR for optimizer update number `step` (0-based) of `total_steps`.

    transformers' convention, step for step (the oracle in tests/training/test_merge_and_schedule.py):
    warmup rises linearly from 0, so update 0 runs at lr 0 (AdamW still fills its moments) and the
    peak is reached at update `warmup`. Issue 31 measured why it matters: mudpuppy's earlier warmup
    (update 0 at peak/warmup) cost held-out accuracy against TRL on the same seeds (docs/benchmarks.md).
    """
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup = warmup_steps_for(cfg, total_steps)
    if step < warmup:
        return peak * step / warmup
    if cfg.lr_scheduler == "constant":
        return peak
    span = max(total_steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    if cfg.lr_scheduler == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    if cfg.lr_scheduler == "polynomial":
        return floor + (peak - floor) * (1.0 - progress) ** cfg.lr_power
    if cfg.lr_scheduler == "cosine_with_restarts":
        # Hard restarts: each of lr_cycles cycles decays from the peak to the floor.
        if progress >= 1.0:
            return floor
        progress = (progress * cfg.lr_cycles) % 1.0
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
