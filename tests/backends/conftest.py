"""Tests under tests/backends simulate GPUs by patching torch.cuda; the machine's own AMD GPUs must not take
part. The ROCm probe reads the kernel's KFD topology and may run amd-smi before torch (torch/devices/kfd.py): here
both see no GPU, unless a test points them at a recorded tree (tests/backends/test_rocm_igpu.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def no_real_amd_gpus(monkeypatch, tmp_path_factory):
    from mudpuppy.backends.torch.devices import kfd

    monkeypatch.setattr(kfd, "KFD_NODES", tmp_path_factory.mktemp("no-kfd") / "nodes")
    monkeypatch.setattr(kfd, "run_amd_smi", lambda *args: "")
