"""`read_hardware(backend)`: what the device of a backend and this process use right now, for the --tui
dashboard (monitor/).

The readings themselves live beside their runtime (backends/torch/devices/telemetry.py
for CUDA and ROCm, backends/mlx/telemetry.py for MLX) and are imported only
when that backend is the one running; the process's own memory, read on
every backend, and the `Reading` type they all return are in
backends/telemetry.py, the leaf the runtime modules import.
"""

from __future__ import annotations

from .telemetry import Reading, process_readings


def read_hardware(backend=None) -> list[Reading]:
    """What the device of `backend` (None: no backend yet) and this process use right now."""
    name = getattr(backend, "name", None)
    readings: list[Reading] = []
    if name in ("cuda", "rocm"):
        from .torch.devices.telemetry import gpu_readings

        readings += gpu_readings(backend.device, name)
    elif name == "mlx":
        from .mlx.telemetry import mlx_readings

        readings += mlx_readings()
    readings += process_readings()
    return readings
