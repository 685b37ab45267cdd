"""Backend registry: real probes, clear refusals, auto-detection order. (`mudpuppy backends` and
`run --backend`: tests/cli/test_verbs.py.)"""

from __future__ import annotations

import os

import pytest

from mudpuppy import create_backend
from mudpuppy.backends import factory
from mudpuppy.backends.protocol import Availability, BackendProtocol
from mudpuppy.errors import BackendUnavailable, MudpuppyError


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
    import mudpuppy.backends.torch.devices.cpu as cpu

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


@pytest.fixture
def restore_determinism():
    import torch

    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]
    if before[3] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def test_training_deterministic_switches_torchs_deterministic_algorithms_on(tiny_config, restore_determinism):
    import torch
    from mudpuppy import load_config, run

    tiny_config["training"]["deterministic"] = True
    cfg = load_config(tiny_config)
    assert cfg.backend_options()["deterministic"] is True
    environ = dict(os.environ)
    backend = create_backend("cpu", **cfg.backend_options())
    assert torch.are_deterministic_algorithms_enabled() and backend.plan.deterministic
    assert dict(os.environ) == environ              # no cuBLAS on the CPU: its workspace setting is not written
    assert any(note.startswith("deterministic: ") for note in backend.plan.notes)
    # Every op of a LoRA step has a deterministic kernel (none stops the run), and on the CPU, already
    # deterministic, the losses are those of a run without the switch.
    tiny_config["training"]["max_steps"] = 2
    tiny_config["eval"] = {"before_training": False, "after_training": False}
    strict = run(load_config(tiny_config), backend, echo=lambda *_: None).losses
    torch.use_deterministic_algorithms(False)
    tiny_config["training"]["deterministic"] = False
    tiny_config["output_dir"] = tiny_config["output_dir"] + "-plain"
    assert run(load_config(tiny_config), create_backend("cpu"), echo=lambda *_: None).losses == strict


def test_training_deterministic_off_leaves_torch_alone(tiny_config, restore_determinism):
    import torch

    torch.use_deterministic_algorithms(False)
    assert not create_backend("cpu").plan.deterministic and not torch.are_deterministic_algorithms_enabled()


def test_mlx_refuses_training_deterministic():
    pytest.importorskip("mlx.core")
    with pytest.raises(MudpuppyError, match="training.deterministic switches torch's deterministic algorithms on; "
                                            "mlx has no such switch"):
        create_backend("mlx", deterministic=True)
