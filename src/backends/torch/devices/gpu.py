"""GPU detection and selection shared by the ROCm and CUDA backends.

torch drives AMD (HIP) and NVIDIA GPUs through the same `torch.cuda` API, so
the mechanics live here once: read each visible GPU, skip the ones known to
crash, prove the rest with a real allocation, pick one, choose a precision,
set the allocator up before torch reads it, and say which attention kernel
will run. What differs between the two vendors (architecture tables, install
commands, allocator defaults) is handed in by `rocm.py` and `cuda.py` as a
`GpuKind`.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ....distributed import from_environment, launched
from ....errors import BackendUnavailable
from ...protocol import Availability
from ..handle import DevicePlan
from ....memory.fit import check_memory_options
from ..optimizers import check_optimizer
from .sdpa import attention_report, describe_attention

# torch reads the first of these that is set. PYTORCH_ALLOC_CONF is the newer,
# device-neutral name (torch >= 2.9); the per-vendor names still work everywhere.
ALLOCATOR_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
# What mudpuppy itself wrote into them, so a second probe does not take it for the user's choice.
_DEFAULTS_SET: dict[str, str] = {}
# Opt-in for integrated GPUs that mudpuppy skips by default (see rocm.py).
ALLOW_IGPU_VAR = "MUDPUPPY_ALLOW_IGPU"
PRECISIONS = ("auto", "bf16", "fp16", "fp32", "fp8")
# Optional packages reported when installed; mudpuppy never requires them.
OPTIONAL_KERNELS = (("bitsandbytes", "bitsandbytes"), ("flash_attn", "flash-attn"))


@dataclass
class Gpu:
    """One GPU as torch numbers it (`cuda:<index>`, after the *_VISIBLE_DEVICES filters)."""

    index: int
    name: str
    arch: str                      # gfx1100 on ROCm, sm_89 on CUDA
    memory_gib: float
    capability: tuple[int, int]
    integrated: bool = False
    bf16: bool = False             # native bf16 matmuls
    fp8: bool = False              # fp8 matmuls in hardware (and this torch has the dtypes)
    problem: str = ""              # why mudpuppy will not use it; empty when usable

    @property
    def usable(self) -> bool:
        return not self.problem

    def describe(self) -> str:
        dtype = "bf16" if self.bf16 else "fp16"
        text = f"cuda:{self.index} ({self.name}, {self.arch}, {self.memory_gib:.0f} GiB, {dtype})"
        return f"{text} skipped: {self.problem}" if self.problem else text

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GpuKind:
    """What differs between ROCm and CUDA; built by rocm.py and cuda.py."""

    name: str                                   # backend name: rocm or cuda
    runtime: Callable[[], str]                  # "HIP 7.2.53211" / "CUDA 12.8"
    check_build: Callable[[], str]              # "" when this torch drives this kind of GPU
    no_gpu_reason: Callable[[], str]
    read_traits: Callable[[Any], dict]          # device properties -> arch, bf16, fp8
    exclude: Callable[[Gpu], str]               # "" to keep a GPU, else why it is skipped
    visibility_vars: tuple[str, ...]            # what a child process reads, in precedence order
    native_allocator_var: str                   # PYTORCH_HIP_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF
    allocator_default: Callable[[], str]
    allocator_notes: Callable[[str], list[str]] # warnings about a value the user set
    fp8_requirement: str                        # which GPUs can do fp8, for the error message


# --------------------------------------------------------------------- builds

def torch_build() -> str:
    """Which GPU runtime this torch was compiled for: rocm, cuda or cpu."""
    if getattr(torch.version, "hip", None):
        return "rocm"
    if getattr(torch.version, "cuda", None):
        return "cuda"
    return "cpu"


def describe_build() -> str:
    build = torch_build()
    if build == "rocm":
        return f"torch {torch.__version__}, the ROCm build (HIP {torch.version.hip})"
    if build == "cuda":
        return f"torch {torch.__version__}, the CUDA build (CUDA {torch.version.cuda})"
    return f"torch {torch.__version__}, the CPU-only build"


def reinstall_command(index_url: str) -> str:
    # A plain `pip install torch` keeps an installed torch of the same version
    # whatever its build, so the wrong build has to go first.
    return f"pip uninstall -y torch && pip install torch --index-url {index_url}"


# ------------------------------------------------------------------ allocator

def set_allocator_defaults(kind: GpuKind, environ: MutableMapping[str, str] | None = None) -> dict:
    """Give torch's caching allocator mudpuppy's defaults unless the user chose their own.

    torch reads these variables once, when the allocator first runs (not at
    import), so this must happen before the first allocation on the GPU: the
    probe calls it before it allocates anything.
    """
    environ = os.environ if environ is None else environ
    for var in ALLOCATOR_VARS:
        value = environ.get(var)
        if value and _DEFAULTS_SET.get(var) == value:
            break  # mudpuppy's own default from an earlier probe in this process
        if value:
            return {"variable": var, "value": value, "source": "user", "notes": kind.allocator_notes(value)}
    value = kind.allocator_default()
    # Both names: newer torch reads PYTORCH_ALLOC_CONF first (and warns about the
    # per-vendor name), older torch only knows the per-vendor one.
    for var in ("PYTORCH_ALLOC_CONF", kind.native_allocator_var):
        environ[var] = _DEFAULTS_SET[var] = value
    notes = []
    if torch.cuda.is_initialized():
        notes.append("torch had already initialised the GPU, so this default reaches child processes only")
    return {"variable": kind.native_allocator_var, "value": value, "source": "mudpuppy", "notes": notes}


def describe_allocator(setting: dict) -> str:
    who = "set by you" if setting["source"] == "user" else "mudpuppy default"
    text = f"{setting['variable']}={setting['value']} ({who})"
    return "; ".join([text, *setting["notes"]])


# ---------------------------------------------------------------- detection

def check_gpu(index: int) -> str:
    """Allocate, multiply and synchronise on one GPU: '' when it computed the right answer.

    A flag such as `is_available()` says a driver answered, not that kernels
    run; some integrated GPUs enumerate fine and then fail on the first matmul.
    """
    device = torch.device("cuda", index)
    x = torch.ones(64, 64, device=device)
    y = x @ x
    torch.cuda.synchronize(device)
    if not bool(torch.isfinite(y).all().item()) or float(y[0, 0].item()) != 64.0:
        return "a 64x64 matmul gave wrong values"
    return ""


def run_check(index: int) -> str:
    try:
        return check_gpu(index)
    except (RuntimeError, AssertionError) as exc:  # driver and HIP errors surface as RuntimeError
        return f"probe failed: {exc}".splitlines()[0]


def read_gpu(kind: GpuKind, index: int) -> Gpu:
    props = torch.cuda.get_device_properties(index)
    traits = kind.read_traits(props)
    return Gpu(
        index=index,
        name=torch.cuda.get_device_name(index) or getattr(props, "name", "GPU"),
        arch=traits["arch"],
        memory_gib=getattr(props, "total_memory", 0) / 2**30,
        capability=(props.major, props.minor),
        integrated=bool(getattr(props, "is_integrated", False)),
        bf16=traits["bf16"],
        fp8=traits["fp8"] and torch_has_fp8(),
    )


def survey_gpus(kind: GpuKind, probe: bool = True) -> list[Gpu]:
    """Every visible GPU, each marked usable or with the reason it is skipped.

    Known-bad GPUs are skipped by name *before* the probe: the integrated GPUs
    in question segfault, which no try/except can catch. With `probe` off (one
    rank of a distributed run) no GPU is allocated on here: reading properties
    creates no context, and `plan_run` probes the one GPU the rank trains on,
    so N ranks make N contexts, not N x N.
    """
    gpus = [read_gpu(kind, i) for i in range(torch.cuda.device_count())]
    for gpu in gpus:
        gpu.problem = kind.exclude(gpu) or (run_check(gpu.index) if probe else "")
    return gpus


def igpu_allowed(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(ALLOW_IGPU_VAR, "").strip().lower() in ("1", "true", "yes")


def torch_has_fp8() -> bool:
    return hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm")


def find_optional_kernels() -> dict[str, str | None]:
    """Installed versions of the optional accelerated packages (None where absent)."""
    found = {}
    for module, dist in OPTIONAL_KERNELS:
        try:
            found[module] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[module] = None
    return found


def probe_kind(kind: GpuKind) -> Availability:
    """The probe behind `mudpuppy backends` and `create_backend` for rocm and cuda."""
    problem = kind.check_build()
    if problem:
        return Availability(kind.name, False, problem)
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return Availability(kind.name, False, kind.no_gpu_reason())
    allocator = set_allocator_defaults(kind)
    gpus = survey_gpus(kind, probe=not launched())
    usable = [g for g in gpus if g.usable]
    details = {
        "torch": torch.__version__, "runtime": kind.runtime(), "gpus": gpus,
        "usable": [g.index for g in usable], "allocator": allocator,
        "optional": find_optional_kernels(), "devices": len(gpus),
        "bf16": bool(usable and usable[0].bf16),
    }
    if not usable:
        listing = "; ".join(g.describe() for g in gpus)
        return Availability(kind.name, False, f"no usable GPU among {len(gpus)}: {listing}", details=details)
    return Availability(kind.name, True, device=describe_devices(kind, gpus, allocator), details=details)


def describe_devices(kind: GpuKind, gpus: list[Gpu], allocator: dict) -> str:
    """What `mudpuppy backends` prints: the default GPU first, then the others and the allocator."""
    first = next(g for g in gpus if g.usable)
    lines = [f"{first.describe()} with {kind.runtime()}"]
    lines += [g.describe() for g in gpus if g is not first]
    lines.append(f"allocator: {describe_allocator(allocator)}")
    return "\n      ".join(lines)


# ---------------------------------------------------------------- selection

def select_device(gpus: list[Gpu], requested: int | list[int] | tuple[int, ...] | None) -> int:
    """The one torch index to train on: the first usable GPU, or the one asked for."""
    if requested is None or requested == [] or requested == ():
        return next(g.index for g in gpus if g.usable)
    wanted = [requested] if isinstance(requested, int) else list(requested)
    listing = ", ".join(g.describe() for g in gpus)
    if len(wanted) > 1:
        raise BackendUnavailable(
            f"devices: {wanted} asks for {len(wanted)} GPUs, but mudpuppy trains on one GPU per run for now "
            f"(no layer placement across GPUs yet); pick one, e.g. devices: [{wanted[0]}]. Visible: {listing}")
    index = wanted[0]
    if not isinstance(index, int) or not 0 <= index < len(gpus):
        raise BackendUnavailable(
            f"devices: [{index}] is not a GPU torch can see; indices run 0..{len(gpus) - 1} "
            f"(counted after HIP_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES). Visible: {listing}")
    if gpus[index].problem:
        raise BackendUnavailable(f"devices: [{index}] cannot be used: {gpus[index].describe()}")
    return index


def select_rank_device(gpus: list[Gpu], requested) -> int:
    """In a distributed run, local rank i trains on the i-th usable GPU (or the i-th of `devices`); an
    integrated GPU the probe excluded never counts, so LOCAL_RANK maps onto usable GPUs only."""
    ranks = from_environment()
    usable = [g.index for g in gpus if g.usable]
    chosen = usable if not requested else ([requested] if isinstance(requested, int) else list(requested))
    listing = ", ".join(g.describe() for g in gpus)
    bad = [i for i in chosen if not (isinstance(i, int) and 0 <= i < len(gpus) and gpus[i].usable)]
    if bad:
        raise BackendUnavailable(f"devices: {bad} are not usable GPUs. Visible: {listing}")
    if ranks.local_world > len(chosen):
        raise BackendUnavailable(
            f"{ranks.local_world} processes on this node but {len(chosen)} usable GPU(s) ({listing}); start at most "
            f"{len(chosen)} (--nproc / torchrun --nproc-per-node), one per GPU")
    return chosen[ranks.local_rank]


def visible_tokens(kind: GpuKind, count: int, environ: Mapping[str, str]) -> list[str]:
    """How the driver names torch's cuda:0..count-1, so a child process can be pointed at the same GPU.

    On ROCm, HIP_VISIBLE_DEVICES (or CUDA_VISIBLE_DEVICES) indexes into what
    ROCR_VISIBLE_DEVICES left visible; mudpuppy leaves ROCR_VISIBLE_DEVICES as
    the user set it, so the ids below keep meaning the same GPUs in a child.
    """
    for var in kind.visibility_vars:
        raw = environ.get(var)
        if raw is not None:
            tokens = [t.strip() for t in raw.split(",") if t.strip()]
            if len(tokens) >= count:
                return tokens[:count]
    return [str(i) for i in range(count)]


def visibility_env(kind: GpuKind, chosen: list[int], count: int,
                   environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The *_VISIBLE_DEVICES values that show a child process only the chosen GPU(s).

    Every variable the child's runtime might read gets the same value, so a
    tool that reads CUDA_VISIBLE_DEVICES and HIP itself agree on the GPU.
    """
    environ = os.environ if environ is None else environ
    tokens = visible_tokens(kind, count, environ)
    value = ",".join(tokens[i] for i in chosen)
    return {var: value for var in kind.visibility_vars}


def child_environment(plan: DevicePlan, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment to start a child process with (a data-loader worker, an export, a server).

    This process keeps its own variables: torch has already enumerated the
    GPUs here, and changing *_VISIBLE_DEVICES under it would renumber them
    for torch's own bookkeeping. What mudpuppy set before HIP started (the
    ROCR_VISIBLE_DEVICES that hides an iGPU, rocm.py) is in os.environ, so a
    child inherits it and the ids in `plan.env` keep counting within it.
    """
    return {**(os.environ if base is None else base), **plan.env}


# ---------------------------------------------------------------- precision

@dataclass(frozen=True)
class Precision:
    name: str                       # bf16, fp16, fp32 or fp8
    autocast: torch.dtype | None    # compute dtype for matmuls; None = fp32
    loss_scaling: bool              # fp16 gradients underflow without it
    why: str


def choose_precision(kind: GpuKind, gpu: Gpu, requested: str | None) -> Precision:
    wanted = (requested or "auto").lower()
    if wanted not in PRECISIONS:
        raise BackendUnavailable(f"precision: {requested!r} is not one of {', '.join(PRECISIONS)}")
    if wanted == "auto":
        if gpu.bf16:
            return Precision("bf16", torch.bfloat16, False, f"{gpu.arch} runs bf16 natively")
        return Precision("fp16", torch.float16, True,
                         f"{gpu.arch} has no native bf16, so fp16 with dynamic loss scaling")
    if wanted == "bf16" and not gpu.bf16:
        raise BackendUnavailable(
            f"precision: bf16 asked for, but {gpu.describe()} has no native bf16; "
            "use precision: fp16 (mudpuppy adds loss scaling) or auto")
    if wanted == "fp8":
        return choose_fp8(kind, gpu)
    return {
        "bf16": Precision("bf16", torch.bfloat16, False, "asked for"),
        "fp16": Precision("fp16", torch.float16, True, "asked for; with dynamic loss scaling"),
        "fp32": Precision("fp32", None, False, "asked for"),
    }[wanted]


def choose_fp8(kind: GpuKind, gpu: Gpu) -> Precision:
    """fp8 only where the GPU has fp8 matmuls and torch has the kernels; never a silent downgrade."""
    if not torch_has_fp8():
        raise BackendUnavailable(f"precision: fp8 needs torch's float8 dtypes and _scaled_mm; "
                                 f"{describe_build()} lacks them (upgrade torch)")
    if not gpu.fp8:
        raise BackendUnavailable(f"precision: fp8 is not supported on {gpu.describe()}: "
                                 f"{kind.fp8_requirement}. Use precision: auto")
    try:
        importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        raise BackendUnavailable("precision: fp8 trains the linear layers with torchao's float8 recipe; "
                                 "install it with: pip install torchao") from None
    # Activations and gradients outside the fp8 matmuls stay bf16.
    return Precision("fp8", torch.bfloat16, False, "asked for; torchao float8 linear layers, bf16 elsewhere")


def make_deterministic(plan: DevicePlan) -> None:
    """training.deterministic: every op torch runs picks its deterministic kernel (index_add, SDPA's backward,
    cuBLAS' reductions on a GPU), or the run stops at the first op that has none, naming it. Process-wide, as
    torch's switch is. cuBLAS also needs CUBLAS_WORKSPACE_CONFIG before its first call: the factory sets it
    before the probe's matmul (factory.create_backend)."""
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    plan.deterministic = True
    plan.notes.append("deterministic: torch's deterministic algorithms (steps repeat bit for bit; slower on a GPU; "
                      "an op without one stops the run, naming it)")


# ---------------------------------------------------------------- attention
# The report itself lives in sdpa.py; it is called through this module's name so tests can stand in for it.


def report_attention(device: torch.device, dtype: torch.dtype | None) -> str:
    # The report is information, not a gate: a failure to ask must not stop a run.
    try:
        return describe_attention(attention_report(device, dtype))
    except (RuntimeError, TypeError, ValueError) as exc:
        return f"sdpa (kernel not determined: {exc})".splitlines()[0]


# ---------------------------------------------------------------------- plan

def plan_run(kind: GpuKind, availability: Availability, devices: int | list[int] | None = None,
             precision: str | None = None, memory=None, optimizer: str = "adamw", distributed=None) -> DevicePlan:
    """Turn a successful probe and the user's options into the DevicePlan TorchBackend runs with."""
    gpus: list[Gpu] = availability.details["gpus"]
    index = select_rank_device(gpus, devices) if launched() else select_device(gpus, devices)
    gpu = gpus[index]
    if launched():                      # the survey left the probe to the GPU this rank trains on
        problem = run_check(index)
        if problem:
            rank = from_environment().local_rank
            raise BackendUnavailable(f"cuda:{index}, local rank {rank}'s GPU, cannot be used: {problem}")
    chosen = choose_precision(kind, gpu, precision)
    device = torch.device("cuda", index)
    # The current device is where everything not placed explicitly lands: NCCL's communicator for the
    # first collective, torchao's offload stream, torch.cuda.* calls without a device. Left at cuda:0,
    # every rank of a multi-GPU run would meet there.
    torch.cuda.set_device(device)
    allocator = availability.details["allocator"]
    env = visibility_env(kind, [index], len(gpus))
    env[allocator["variable"]] = allocator["value"]
    attention = report_attention(device, chosen.autocast)
    notes = [
        f"device: {gpu.describe()} with {kind.runtime()}",
        *availability.details.get("visibility", []),      # an iGPU hidden from HIP (rocm.py), and why
        f"precision: {chosen.name} ({chosen.why})",
        f"allocator: {describe_allocator(allocator)}",
        f"attention: {attention}",
        "loading: tensor by tensor at storage precision, straight onto the GPU (never device_map='auto')",
        f"child processes: {', '.join(f'{k}={v}' for k, v in sorted(env.items()))}",
    ]
    notes += [g.describe() for g in gpus if g.problem]  # each reads "cuda:N (...) skipped: why"
    extras = {k: v for k, v in availability.details.get("optional", {}).items() if v}
    if extras:
        # Reported, not used: SDPA and mudpuppy's own quantizers are the paths it runs.
        notes.append("optional packages found: " + ", ".join(f"{k} {v}" for k, v in extras.items()))
    return DevicePlan(
        kind.name, device, chosen.autocast, notes=notes, loss_scaling=chosen.loss_scaling,
        env=env, attention=attention, devices=[index], precision=chosen.name, fp8=chosen.name == "fp8",
        memory=memory, optimizer=optimizer, distributed=distributed,
    )


def plan_gpu_run(kind: GpuKind, availability: Availability, devices: int | list[int] | None = None,
                 precision: str | None = None, memory=None, optimizer: str = "adamw", distributed=None,
                 deterministic: bool = False) -> DevicePlan:
    """What `create` of rocm.py and cuda.py does before the backend is built: refuse memory options and an
    optimizer this GPU cannot run before any model loads, then plan the run (and make it deterministic)."""
    check_memory_options(kind.name, memory, separate=True)
    check_optimizer(kind.name, optimizer, memory)
    plan = plan_run(kind, availability, devices, precision, memory, optimizer, distributed)
    if deterministic:
        make_deterministic(plan)
    return plan


__all__ = [
    "Gpu", "GpuKind", "Precision", "attention_report", "check_gpu", "child_environment", "choose_precision",
    "describe_build", "find_optional_kernels", "plan_gpu_run", "plan_run", "probe_kind", "select_device",
    "set_allocator_defaults", "survey_gpus", "torch_build", "visibility_env",
]
