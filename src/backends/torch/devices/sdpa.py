"""Which of torch's scaled_dot_product_attention kernels really runs on a device, and why not a faster one.

torch picks among flash, memory-efficient, cuDNN and math kernels per call.
mudpuppy asks torch's own chooser, for plain causal batches and for masked
(padded or packed) ones, and reports the answer in the run's notes.

On ROCm the flash and memory-efficient kernels come from AOTriton, which marks
some architectures experimental (RDNA3, gfx11xx, on the releases torch ships
now): there torch turns both kernels off unless
TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1 was set before its first attention
call, and falls back to the math kernel (slower, and it holds the whole
attention matrix). torch says so once per process, as a warning; the report
catches it and says what to set.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

AOTRITON_GATE_VAR = "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL"
# Where AOTriton's gate applies: used when torch's warning was already spent earlier in the process.
AOTRITON_EXPERIMENTAL_PREFIXES = ("gfx11",)
KERNEL_NAMES = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "memory-efficient",
                "CUDNN_ATTENTION": "cudnn", "MATH": "math", "OVERRIDEABLE": "overrideable", "ERROR": "none"}


def pick_sdpa_kernel(q: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> str:
    """The kernel torch's scaled_dot_product_attention would dispatch to for these inputs."""
    from torch.nn.attention import SDPBackend

    try:
        choice = torch._fused_sdp_choice(q, q, q, mask, 0.0, causal)
        return KERNEL_NAMES.get(SDPBackend(choice).name, SDPBackend(choice).name.lower())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        # Older torch without the private chooser: ask the public checks in torch's order.
        params = torch.backends.cuda.SDPAParams(q, q, q, mask, 0.0, causal, False)
        if q.is_cuda and torch.backends.cuda.can_use_flash_attention(params):
            return "flash"
        if q.is_cuda and torch.backends.cuda.can_use_efficient_attention(params):
            return "memory-efficient"
        return "math"


def device_arch(device: torch.device) -> str:
    """gfx1100 for a ROCm GPU; '' elsewhere (the gate is AMD's only)."""
    if device.type != "cuda" or not getattr(torch.version, "hip", None):
        return ""
    return (getattr(torch.cuda.get_device_properties(device), "gcnArchName", "") or "").split(":")[0]


def aotriton_gate(arch: str, warned: bool, causal_kernel: str, environ: Mapping[str, str] | None = None) -> str:
    """'gated' when AOTriton's experimental gate keeps flash and memory-efficient off on this GPU,
    'enabled' when the variable lifted it, '' when the gate plays no part."""
    environ = os.environ if environ is None else environ
    if not arch:
        return ""
    enabled = environ.get(AOTRITON_GATE_VAR, "").strip() == "1"   # torch reads "1" as true, nothing else
    if warned or (not enabled and arch.startswith(AOTRITON_EXPERIMENTAL_PREFIXES) and causal_kernel == "math"):
        return "gated"
    fast = causal_kernel in ("flash", "memory-efficient")
    return "enabled" if enabled and fast and arch.startswith(AOTRITON_EXPERIMENTAL_PREFIXES) else ""


def attention_report(device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                     head_dim: int = 64, seq_len: int = 128) -> dict[str, Any]:
    """Which SDPA kernel runs for plain causal batches and for masked (padded or packed) ones.

    Masked batches matter: flash kernels take no arbitrary mask, so padded or
    packed batches fall to the memory-efficient or math kernel.
    """
    device = torch.device(device)
    dtype = dtype or torch.float32
    q = torch.zeros(1, 4, seq_len, head_dim, device=device, dtype=dtype)
    mask = torch.ones(seq_len, seq_len, device=device, dtype=torch.bool).tril()
    backends = torch.backends.cuda
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        causal, masked = pick_sdpa_kernel(q, None, True), pick_sdpa_kernel(q, mask, False)
    warned = any(AOTRITON_GATE_VAR in str(w.message) for w in caught)
    arch = device_arch(device)
    return {
        "device": str(device), "dtype": str(dtype).replace("torch.", ""), "arch": arch,
        "causal": causal, "masked": masked, "aotriton_gate": aotriton_gate(arch, warned, causal),
        "enabled": {"flash": backends.flash_sdp_enabled(), "memory-efficient": backends.mem_efficient_sdp_enabled(),
                    "math": backends.math_sdp_enabled(),
                    "cudnn": getattr(backends, "cudnn_sdp_enabled", lambda: False)()},
        "flash_built": bool(getattr(backends, "is_flash_attention_available", lambda: False)()),
    }


def describe_attention(report: dict[str, Any]) -> str:
    text = (f"sdpa: {report['causal']} kernel for causal batches, {report['masked']} for padded/packed "
            f"({report['dtype']})")
    gate, arch = report.get("aotriton_gate", ""), report.get("arch", "")
    if gate == "gated":
        text += (f"; AOTriton's flash and memory-efficient kernels are experimental on {arch} and off: set "
                 f"{AOTRITON_GATE_VAR}=1 before starting mudpuppy to use them (faster, and no full attention "
                 "matrix in memory)")
    elif gate == "enabled":
        text += f"; AOTriton's experimental kernels for {arch}, enabled by {AOTRITON_GATE_VAR}=1"
    return text
