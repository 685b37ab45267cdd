"""`mudpuppy.quantization` is the public import path of code that lives under backends/torch/: importing
it imports no torch, and every name it gives is the torch module's own object (a re-export, not a copy)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from mudpuppy import quantization

HOMES = {
    "kernels": ("quantization.kernels", "quantization.quantized_linear", "model.sdpa_attention"),
    "qat": ("quantization.qat.layers", "quantization.qat.files"),
    "gptq": ("quantization.gptq.sweep", "quantization.gptq.layers", "quantization.gptq.files"),
    "gptq_format": ("quantization.gptq.format",),
}


def test_importing_the_package_imports_no_torch():
    code = "import sys, mudpuppy.quantization; print(sorted(m for m in ('torch', 'torchao') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("public", sorted(HOMES))
def test_every_public_name_is_the_torch_modules_own(public):
    module = importlib.import_module(f"mudpuppy.quantization.{public}")
    homes = [importlib.import_module(f"mudpuppy.backends.torch.{name}") for name in HOMES[public]]
    aliases = getattr(module, "SEED_ALIASES", {})
    assert module.__all__
    for name in module.__all__:
        real = aliases.get(name, name)
        owners = [home for home in homes if hasattr(home, real)]
        assert owners and getattr(module, name) is getattr(owners[0], real), name


def test_the_seeds_names_are_aliases_of_what_they_are():
    """`fbgemm` is not Meta's FBGEMM and `flash_attention` is plain SDPA: the seed's names stay, as aliases."""
    from mudpuppy.quantization import kernels

    assert kernels.SEED_ALIASES == {"fbgemm": "qgemm_bias_act", "flash_attention": "sdpa_attention",
                                    "FlashMHA": "SdpaSelfAttention"}
    for alias, real in kernels.SEED_ALIASES.items():
        assert getattr(quantization, alias) is getattr(kernels, real) is getattr(kernels, alias)


def test_the_package_names_resolve_to_the_same_objects():
    from mudpuppy.quantization import kernels, qat

    for name in quantization.__all__:
        assert any(getattr(quantization, name) is getattr(m, name, None) for m in (kernels, qat)), name
