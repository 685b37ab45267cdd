"""The runtime-neutral memory checks and messages (memory/fit.py), as both backends use them."""

from __future__ import annotations

from pathlib import Path

import pytest

from mudpuppy.config import MemoryConfig, TrainingConfig
from mudpuppy.errors import MudpuppyError, OutOfDeviceMemory
from mudpuppy.memory.fit import UNIFIED_MEMORY, check_memory_options, out_of_memory, out_of_memory_message


def test_offload_is_refused_by_key_where_device_memory_is_host_memory():
    memory = MemoryConfig(optimizer_offload=True, activation_offload=True)
    with pytest.raises(MudpuppyError) as err:
        check_memory_options("cpu", memory, separate=False)
    message = str(err.value)
    assert message.startswith("memory.optimizer_offload, memory.activation_offload: the cpu backend computes "
                              "in host memory")
    assert message.endswith("(turn them off on this backend)")


def test_unified_memory_names_its_own_reason():
    with pytest.raises(MudpuppyError, match="^memory.stream_layers: the mlx backend runs on unified memory"):
        check_memory_options("mlx", MemoryConfig(stream_layers=True), separate=False, reason=UNIFIED_MEMORY)


def test_a_device_with_its_own_memory_takes_every_option():
    check_memory_options("cuda", MemoryConfig(optimizer_offload=True, activation_offload=True,
                                              stream_layers=True), separate=True)
    check_memory_options("cpu", MemoryConfig(), separate=False)
    check_memory_options("cpu", None, separate=False)


def test_out_of_memory_message_on_a_gpu_offers_offload_in_order():
    training = TrainingConfig(micro_batch_size=1)
    text = out_of_memory_message("rocm", training, "qlora", MemoryConfig(activation_offload=True), gpu=True)
    assert "memory.activation_offload" not in text           # already on
    assert text.index("memory.optimizer_offload") < text.index("memory.stream_layers") < text.index("sequence_len")
    assert "micro_batch_size" not in text and "adapter.type" not in text


def test_out_of_memory_says_what_the_run_kept():
    kept = out_of_memory(OutOfDeviceMemory("out."), 4, Path("run/checkpoints/step-00000004"))
    assert str(kept).startswith("step 5: out. Nothing of this step was saved; the newest complete checkpoint, ")
    none = out_of_memory(OutOfDeviceMemory("out."), 0, None)
    assert "no checkpoint had been written yet" in str(none)
