"""Hide integrated AMD GPUs from HIP before it starts, so work on the discrete card runs.

With a small iGPU visible (the gfx1036 of a Ryzen 7000/9000 desktop, a 780M),
HIP loads code objects for every GPU it sees, and work on the discrete card
fails at its first allocation ("invalid device kernel image") or segfaults.
Skipping the iGPU when choosing a device is not enough: HIP must not see it.
HIP reads its visibility variables once, when it initialises, so they have to
be set in this process before torch touches the GPU, or the process has to
start again with them set.

The rules: a visibility variable the user set is theirs (HIP_VISIBLE_DEVICES,
CUDA_VISIBLE_DEVICES or GPU_DEVICE_ORDINAL: mudpuppy changes nothing; only
ROCR_VISIBLE_DEVICES: mudpuppy narrows within it through HIP_VISIBLE_DEVICES,
whose indices count what ROCR left visible). Otherwise it sets
ROCR_VISIBLE_DEVICES, whose indices are the KFD order kfd.py reads. Nothing
is hidden when the iGPUs are all there is, or when MUDPUPPY_ALLOW_IGPU is set.
torch-free: rocm.py supplies the policy (which GPU is a small iGPU) and
whether HIP has started.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field

from .kfd import KfdGpu

ROCR_VAR = "ROCR_VISIBLE_DEVICES"
HIP_VAR = "HIP_VISIBLE_DEVICES"
# HIP reads any of these as its own device list; one set by the user ends mudpuppy's part.
HIP_LEVEL_VARS = (HIP_VAR, "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")
# Set in the environment of a re-executed process: what was set, so it happens at most once.
REEXEC_MARKER = "MUDPUPPY_VISIBILITY_REEXEC"
# What mudpuppy itself wrote in this process, so a second probe does not take it for the user's.
_SET: dict[str, str] = {}


@dataclass
class Decision:
    """What to hide and how; `variable` is empty when nothing is to be set."""

    variable: str = ""
    value: str = ""
    hidden: list[tuple[KfdGpu, str]] = field(default_factory=list)   # each with why
    notes: list[str] = field(default_factory=list)
    in_effect: bool = False   # mudpuppy set it already (earlier in this process, or before re-executing)


def set_by_mudpuppy(var: str, environ: MutableMapping[str, str]) -> bool:
    value = environ.get(var)
    return value is not None and (_SET.get(var) == value or environ.get(REEXEC_MARKER) == f"{var}={value}")


def user_setting(environ: MutableMapping[str, str], names) -> tuple[str, str] | None:
    for var in names:
        if var in environ and not set_by_mudpuppy(var, environ):
            return var, environ[var]
    return None


def resolve_rocr(tokens: list[str], gpus: list[KfdGpu]) -> list[KfdGpu] | None:
    """The GPUs ROCR_VISIBLE_DEVICES leaves visible, in the order HIP numbers them; None if unreadable.

    ROCr takes indices or GPU-<uuid>, and stops at the first token it cannot use.
    """
    by_uuid = {g.uuid().lower(): g for g in gpus if g.unique_id}
    chosen: list[KfdGpu] = []
    for token in tokens:
        gpu = gpus[int(token)] if token.isdigit() and int(token) < len(gpus) else by_uuid.get(token.lower())
        if gpu is None or gpu in chosen:
            return None
        chosen.append(gpu)
    return chosen


def decide(gpus: list[KfdGpu] | None, reason: Callable[[KfdGpu], str],
           environ: MutableMapping[str, str]) -> Decision:
    """Which visibility variable to set, to what, and why; nothing set where the user already chose."""
    if not gpus or not any(reason(g) for g in gpus):
        return Decision()
    user_hip = user_setting(environ, HIP_LEVEL_VARS)
    if user_hip:
        return Decision(notes=[f"visibility: {user_hip[0]}={user_hip[1]} set by you; mudpuppy hides no GPU"])
    rocr = user_setting(environ, (ROCR_VAR,))
    candidates = gpus
    if rocr:
        candidates = resolve_rocr([t.strip() for t in rocr[1].split(",") if t.strip()], gpus)
        if candidates is None:
            return Decision(notes=[f"visibility: {ROCR_VAR}={rocr[1]} set by you (not matched to the KFD "
                                   "topology); mudpuppy hides no GPU"])
    hidden = [(g, why) for g in candidates if (why := reason(g))]
    kept = [position for position, g in enumerate(candidates) if not reason(g)]
    if not hidden or not kept:
        return Decision()  # nothing to hide, or nothing to hide it for: the device survey decides
    variable = HIP_VAR if rocr else ROCR_VAR
    value = ",".join(str(position) for position in kept)
    return Decision(variable, value, hidden, in_effect=set_by_mudpuppy(variable, environ)
                    and environ.get(variable) == value)


def describe(decision: Decision, how: str, allow_var: str) -> list[str]:
    gone = "; ".join(f"{gpu.describe()}: {why}" for gpu, why in decision.hidden)
    return [f"visibility: {decision.variable}={decision.value} ({how}) hides {gone}. "
            f"An iGPU visible to HIP breaks work on the discrete card; set {allow_var}=1, or your own "
            f"{decision.variable}, to choose otherwise"]


def started_from_cli() -> bool:
    """Whether this process is the `mudpuppy` command (or `python -m mudpuppy`), not a user's Python."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name in ("mudpuppy", "mudpuppy.__main__"):
        return True
    return getattr(getattr(main, "main", None), "__module__", "").startswith("mudpuppy.cli")


def reexecute(environ: MutableMapping[str, str], variable: str, value: str,
              execve: Callable | None = None) -> None:
    """Start this command again, in this process, with the variable set; HIP then reads it at startup."""
    env = {**environ, variable: value, REEXEC_MARKER: f"{variable}={value}"}
    argv = [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    (execve or os.execve)(sys.executable, argv, env)


def apply(decision: Decision, hip_started: bool, allow_var: str,
          environ: MutableMapping[str, str] | None = None, from_cli: bool | None = None,
          execve: Callable | None = None) -> str:
    """Put the decision into effect; '' when done, else why it cannot be (a library call after HIP started).

    Adds what was done to `decision.notes`. Re-executes the `mudpuppy` command when HIP has started,
    once: the marker stops a second round.
    """
    environ = os.environ if environ is None else environ
    if not decision.variable:
        return ""
    if decision.in_effect:
        how = "restarted once to set it before HIP started" if REEXEC_MARKER in environ else "set by mudpuppy"
        decision.notes += describe(decision, how, allow_var)
        return ""
    if not hip_started:
        environ[decision.variable] = _SET[decision.variable] = decision.value
        decision.notes += describe(decision, "set by mudpuppy before HIP started", allow_var)
        return ""
    setting = f"{decision.variable}={decision.value}"
    hidden = ", ".join(gpu.describe() for gpu, _ in decision.hidden)
    if environ.get(REEXEC_MARKER) is None and (started_from_cli() if from_cli is None else from_cli):
        try:
            reexecute(environ, decision.variable, decision.value, execve)
        except OSError:
            pass  # could not start again: say what to set instead
    return (f"HIP had already started in this process with an integrated GPU visible ({hidden}), and work on "
            f"the discrete GPU then fails at its first allocation. Set {setting} in the environment before "
            f"Python starts (or before the first torch.cuda call), or {allow_var}=1 to keep the iGPU")
