"""Fitting a run in memory and reporting what it used: the runtime-neutral memory features, in one place.

fit.py      which memory options a device can take (`check_memory_options`, one check that both
            backends call with their own reason), and what to say when a step runs out of device
            memory (the things to try, and what the run kept);
phases.py   the peak device memory of each phase of a run, for run_summary.json's `memory`.

What needs a runtime stays beside it: activation offload, releasing the allocator's blocks and turning
torch's OutOfMemoryError into OutOfDeviceMemory in backends/torch/memory.py; MLX's peak memory in
backends/mlx/backend.py. The --tui dashboard's hardware readings (memory and utilisation) come through
backends/hardware.py, with the process's own memory in backends/telemetry.py.
"""
