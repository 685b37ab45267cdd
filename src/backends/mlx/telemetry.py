"""MLX memory readings for the --tui dashboard (see backends/telemetry.py).

MLX counts what its arrays hold (active), its peak and its buffer cache;
on Apple Silicon the device reports its unified memory size and the working
set Metal recommends, the number that matters before the system starts to
swap. MLX exposes no utilisation counter.
"""

from __future__ import annotations

import mlx.core as mx

from ..telemetry import Reading


def mlx_readings() -> list[Reading]:
    total = device_memory()
    return [Reading("MLX active", used=mx.get_active_memory(), total=total, source="mlx"),
            Reading("MLX peak", used=mx.get_peak_memory(), total=total, source="mlx"),
            Reading("MLX cache", used=mx.get_cache_memory(), total=total, source="mlx")]


def device_memory() -> float | None:
    """The working set Metal recommends (else the memory size); None on MLX's CPU build, which reports neither."""
    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    return info.get("max_recommended_working_set_size") or info.get("memory_size")
