"""Backend registry: real probes, clear refusals, auto-detection order."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from mudpuppy import create_backend
from mudpuppy.backends import factory
from mudpuppy.backends.protocol import Availability, BackendProtocol
from mudpuppy.cli import main
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


def test_cli_backends_lists_each_backend_with_a_verdict():
    res = CliRunner().invoke(main, ["backends"])
    assert res.exit_code == 0
    lines = [l for l in res.output.splitlines() if not l.startswith(" ")]
    assert [l.split()[0] for l in lines] == ["rocm", "cuda", "mlx", "cpu"]
    assert all(("available" in l) for l in lines)
    assert any(l.startswith("cpu") and "unavailable" not in l for l in lines)


def test_cli_run_with_unavailable_backend_exits_2(tiny_config, tmp_path):
    import yaml

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_config))
    res = CliRunner().invoke(main, ["run", "--config", str(path), "--backend", "rocm"])
    import torch

    if torch.version.hip:
        pytest.skip("ROCm build present")
    assert res.exit_code == 2
    assert "error: rocm:" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("precision", ["fp16", "fp8"])
def test_cpu_refuses_gpu_only_precisions(precision):
    from mudpuppy.errors import MudpuppyError

    with pytest.raises(MudpuppyError, match=f"training.precision: {precision} needs a GPU"):
        create_backend("cpu", precision=precision)


def test_cpu_reports_its_precision_choice():
    backend = create_backend("cpu", precision="auto")
    assert backend.plan.notes and backend.plan.notes[0].startswith("precision: ")
