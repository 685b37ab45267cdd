"""Backend registry: real probes, clear refusals, auto-detection order. (`mudpuppy backends` and
`run --backend`: tests/cli/test_verbs.py.)"""

from __future__ import annotations

import pytest

from mudpuppy import create_backend
from mudpuppy.backends import factory
from mudpuppy.backends.protocol import Availability, BackendProtocol
from mudpuppy.errors import BackendUnavailable


def test_registry_holds_every_backend():
    assert factory.backend_names() == ["rocm", "cuda", "mlx", "cpu"]


def test_cpu_backend_is_available_and_satisfies_the_protocol():
    result = factory.probe("cpu")
    assert result.available and result.device.startswith("cpu")
    backend = create_backend("cpu")
    assert isinstance(backend, BackendProtocol)
    assert backend.name == "cpu"


def test_unknown_backend_is_refused_with_choices():
    with pytest.raises(BackendUnavailable, match="unknown backend 'tpu'.*auto, rocm, cuda, mlx, cpu"):
        create_backend("tpu")


def test_unavailable_backend_says_why_and_lists_what_is_available(monkeypatch):
    monkeypatch.setattr(factory, "probe", lambda name: Availability(name, name == "cpu", "" if name == "cpu" else f"{name}: not here"))
    with pytest.raises(BackendUnavailable) as info:
        create_backend("rocm")
    text = str(info.value)
    assert text.startswith("rocm: rocm: not here")
    assert "available here: cpu" in text


def test_rocm_probe_on_a_cpu_build_names_the_torch_build():
    import torch

    if torch.version.hip:
        pytest.skip("this torch build has HIP")
    result = factory.probe("rocm")
    assert not result.available
    assert "has no HIP support" in result.reason and torch.__version__ in result.reason
    assert "pip install torch --index-url" in result.reason


def test_auto_prefers_gpus_and_ends_on_cpu():
    verdicts = {"rocm": False, "cuda": True, "mlx": True, "cpu": True}
    pick = factory.resolve_auto(lambda n: Availability(n, verdicts[n], details={"gpu": False}))
    assert pick.name == "cuda"
    verdicts["cuda"] = False
    # MLX on a CPU (Linux) is ~30x slower than torch: auto must not choose it.
    assert factory.resolve_auto(lambda n: Availability(n, verdicts[n], details={"gpu": False})).name == "cpu"
    assert factory.resolve_auto(lambda n: Availability(n, verdicts[n], details={"gpu": n == "mlx"})).name == "mlx"


def test_a_probe_that_crashes_reports_unavailable(monkeypatch):
    import mudpuppy.backends.torch.cpu as cpu

    def boom():
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(cpu, "probe", boom)
    result = factory.probe("cpu")
    assert not result.available and "driver exploded" in result.reason


@pytest.mark.parametrize("precision", ["fp16", "fp8"])
def test_cpu_refuses_gpu_only_precisions(precision):
    from mudpuppy.errors import MudpuppyError

    with pytest.raises(MudpuppyError, match=f"training.precision: {precision} needs a GPU"):
        create_backend("cpu", precision=precision)


def test_cpu_reports_its_precision_choice():
    backend = create_backend("cpu", precision="auto")
    assert backend.plan.notes and backend.plan.notes[0].startswith("precision: ")
