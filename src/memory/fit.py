"""Which memory options a device can take, and what to try after running out of device memory.

Runtime-neutral: the backends call these with their name and what their memory is
(backends/torch/devices/, backends/mlx/); the training loop adds what the run kept.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import MudpuppyError, OutOfDeviceMemory

# Why a backend without separate device memory cannot honour offload or streaming, by kind of memory.
HOST_MEMORY = "the {backend} backend computes in host memory, so there is nothing to move there"
UNIFIED_MEMORY = ("the {backend} backend runs on unified memory (the CPU and the GPU share one memory), "
                  "so there is no host memory to offload or stream to")


def check_memory_options(backend: str, memory, separate: bool, reason: str = HOST_MEMORY) -> None:
    """Refuse, before any model loads, offload or streaming where the device has no memory of its own
    (`separate` False); `reason` says why, naming the backend."""
    asked = memory.requested() if memory is not None else []
    if asked and not separate:
        raise MudpuppyError(
            f"{', '.join(asked)}: {reason.format(backend=backend)}; "
            "offload and streaming are for ROCm and CUDA GPUs (turn them off on this backend)")


def out_of_memory_message(backend: str, training_cfg, adapter_type: str | None, memory, gpu: bool) -> str:
    """What to try after running out of device memory, most likely to help first, skipping what is on
    (and the offload options where the device memory is host memory: nothing to offload to)."""
    tries = []
    if training_cfg.gradient_checkpointing is False:
        tries.append("training.gradient_checkpointing: true (activations recomputed, not kept)")
    if training_cfg.micro_batch_size > 1:
        tries.append(f"a smaller training.micro_batch_size (now {training_cfg.micro_batch_size}) with "
                     "training.gradient_accumulation_steps raised to keep the batch")
    if adapter_type == "none":
        tries.append("adapter.type: lora (only adapter weights train; no optimizer state for the base)")
    elif adapter_type in ("lora", "dora"):
        tries.append("adapter.type: qlora (the frozen base in 4 bits)")
    wanted = [
        ("optimizer_offload", "memory.optimizer_offload: true (optimizer state and fp32 master weights in host memory)"),
        ("activation_offload", "memory.activation_offload: true (saved activations in host memory)"),
        ("stream_layers", "memory.stream_layers: true (frozen base layers in host memory, visiting the device per use)"),
    ]
    for key, text in wanted if gpu else []:
        if not (memory is not None and getattr(memory, key, False)):
            if key != "stream_layers" or adapter_type not in (None, "none"):
                tries.append(text)
    tries.append("a shorter data.sequence_len")
    listed = "; ".join(f"({i}) {t}" for i, t in enumerate(tries, 1))
    return f"out of memory on the {backend} backend during a training step. To fit, try in this order: {listed}."


def out_of_memory(exc: OutOfDeviceMemory, step: int, newest: Path | None) -> OutOfDeviceMemory:
    """Nothing of this step is saved; the newest complete checkpoint is where a resume starts."""
    where = (f"the newest complete checkpoint, {newest}, is kept: continue from it with --resume once the run fits"
             if newest else "no checkpoint had been written yet (training.save_steps writes them)")
    return OutOfDeviceMemory(f"step {step + 1}: {exc} Nothing of this step was saved; {where}.")
