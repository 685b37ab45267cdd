"""`mudpuppy.quantization` is the public import path of code that lives under backends/torch/: importing
it imports no torch, and every name it gives is the torch module's own object (a re-export, not a copy)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from mudpuppy import quantization

HOMES = {
    "kernels": ("kernels", "quantized_linear"),
    "qat": ("qat.layers", "qat.files"),
    "gptq": ("gptq.sweep", "gptq.layers", "gptq.files"),
    "gptq_format": ("gptq.format",),
}


def test_importing_the_package_imports_no_torch():
    code = "import sys, mudpuppy.quantization; print(sorted(m for m in ('torch', 'torchao') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("public", sorted(HOMES))
def test_every_public_name_is_the_torch_modules_own(public):
    module = importlib.import_module(f"mudpuppy.quantization.{public}")
    homes = [importlib.import_module(f"mudpuppy.backends.torch.quantization.{name}") for name in HOMES[public]]
    assert module.__all__
    for name in module.__all__:
        owners = [home for home in homes if hasattr(home, name)]
        assert owners and getattr(module, name) is getattr(owners[0], name), name


def test_the_package_names_resolve_to_the_same_objects():
    from mudpuppy.quantization import kernels, qat

    for name in quantization.__all__:
        assert any(getattr(quantization, name) is getattr(m, name, None) for m in (kernels, qat)), name
