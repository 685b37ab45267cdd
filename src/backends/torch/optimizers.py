"""Optimizers for the torch backends: AdamW, SGD, Adafactor, torchao's low-bit AdamW, and host offload.

`build_optimizer(params, cfg, plan)` returns what TorchTrainer steps; `check_optimizer`
refuses, before the model loads, what cannot run. Which code runs where:

- adamw / sgd / adafactor: torch.optim. AdamW uses torch's fused kernel where the
  parameters live in CPU memory (one vectorised pass; 2.3x faster than foreach on
  16M parameters on the project's 2-core machine) and foreach on GPUs.
- adamw_8bit / adamw_4bit: torchao's AdamW8bit / AdamW4bit (torchao >= 0.11, where they left
  `torchao.prototype`). They quantize the two moments block-wise (256 values a block for
  8-bit, 128 for 4-bit) only in tensors of >= 4096 values whose size the block divides;
  smaller tensors keep fp32 moments. Each update is a torch.compile'd function, so the
  CPU needs a C++ compiler and a GPU needs triton. They run on CPUs and CUDA/ROCm GPUs.
- memory.optimizer_offload (ZeRO-Offload): fp32 master weights and the optimizer state
  live in host memory. torchao's CPUOffloadOptimizer runs only where all its constraints
  hold (see `uses_torchao_offload`): it asserts a CUDA/ROCm device, copies gradients to
  the host *during* backward (so clip_grad_norm_ and GradScaler.unscale_, which change
  the device gradients afterwards, would not reach the step), wraps plain AdamW, and its
  host copies keep the parameters' dtype. In exchange it overlaps those copies with
  backward. Everywhere else `HostOffloadOptimizer` does the same work after backward;
  its state_dict has the plain optimizer's layout, so offload can change between a run
  and its resume (torchao's has a layout of its own).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re

import torch

from ...errors import MudpuppyError
from .compile import cpp_compiler_found

LOW_BIT = {"adamw_8bit": "AdamW8bit", "adamw_4bit": "AdamW4bit"}
TORCHAO_INSTALL = "pip install 'mudpuppy[torchao]'  (or: pip install torchao)"
TORCHAO_MIN = (0, 11)                  # torchao.optim.AdamW8bit / AdamW4bit / CPUOffloadOptimizer
BACKEND_DEVICE = {"cpu": "cpu", "cuda": "cuda", "rocm": "cuda"}   # ROCm shows as cuda in torch
LORAPLUS_EMBEDDING_LR = 1e-6           # create_loraplus_optimizer's loraplus_lr_embedding default


# ------------------------------------------------------------------ checks

def check_optimizer(backend: str, name: str, memory=None) -> None:
    """Refuse, before any model loads, an optimizer this backend cannot run.

    With `memory.optimizer_offload` the update runs on the host CPU, whatever the backend.
    """
    if name not in LOW_BIT:
        return
    offload = bool(memory is not None and memory.optimizer_offload)
    problem = low_bit_problem(name, "cpu" if offload else BACKEND_DEVICE.get(backend, backend))
    if problem:
        raise MudpuppyError(f"training.optimizer: {name} on the {backend} backend {problem}")


def low_bit_problem(name: str, device_type: str) -> str | None:
    """Why torchao's low-bit AdamW cannot update parameters on `device_type` here, or None."""
    cls = LOW_BIT[name]
    if device_type not in ("cpu", "cuda"):
        return f"uses torchao's {cls}, which runs on CPUs and CUDA/ROCm GPUs only; use adamw"
    if importlib.util.find_spec("torchao") is None:
        return (f"uses torchao's {cls}, and torchao is not installed; install it with {TORCHAO_INSTALL}, "
                "or use adamw")
    version = _torchao_version()
    if version is not None and version < TORCHAO_MIN:
        return (f"needs torchao >= {'.'.join(map(str, TORCHAO_MIN))} for torchao.optim.{cls} (installed: "
                f"{importlib.metadata.version('torchao')}); upgrade with pip install -U torchao, or use adamw")
    if device_type == "cpu" and not cpp_compiler_found():
        return (f"compiles torchao's {cls} update with torch.compile, which on the CPU needs a C++ compiler "
                "(g++, or the one $CXX names) and none was found; install one (apt install g++), or use adamw")
    if device_type == "cuda" and importlib.util.find_spec("triton") is None:
        return (f"compiles torchao's {cls} update with torch.compile, which on a GPU needs triton (shipped "
                "with torch's CUDA and ROCm wheels; pip install triton); or use adamw")
    return None


def _torchao_version() -> tuple[int, int] | None:
    """(major, minor) from the installed metadata, without importing torchao; None if unknown."""
    try:
        found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("torchao"))
    except importlib.metadata.PackageNotFoundError:
        return None            # a source checkout: the import at build time decides
    return (int(found[1]), int(found[2])) if found else None


# ------------------------------------------------------------------ building

def build_optimizer(params, cfg, plan, model=None):
    """The optimizer `cfg.optimizer` over `params` (the trainable parameters, on `plan.device`).

    `cfg` is a TrainingConfig, `plan` a DevicePlan; `plan.memory.optimizer_offload` moves the
    state and fp32 master weights to `plan.host`. Whatever comes back has step(),
    zero_grad(set_to_none=True), param_groups (whose "lr" the trainer sets before each
    step, times the group's "lr_ratio"), state_dict() and load_state_dict().
    With `cfg.loraplus_lr_ratio` the parameters of `model` form LoRA+'s groups (`loraplus_groups`).
    """
    params = list(params)
    layout = None
    if getattr(cfg, "loraplus_lr_ratio", None) is not None:
        groups = loraplus_groups(model, params, cfg)
        params = [p for group in groups for p in group["params"]]
        layout = [(len(g["params"]), {k: v for k, v in g.items() if k != "params"}) for g in groups]
    offload = bool(plan.memory is not None and plan.memory.optimizer_offload)
    if cfg.optimizer in LOW_BIT:
        update_device = plan.host.type if offload else plan.device.type
        problem = low_bit_problem(cfg.optimizer, update_device)
        if problem:
            raise MudpuppyError(f"training.optimizer: {cfg.optimizer} on the {plan.name} backend {problem}")
    if not offload:
        return make_torch_optimizer(params, cfg, layout)
    if layout is None and uses_torchao_offload(params, cfg, plan):
        return _torchao_offload(params, cfg)
    pin = plan.device.type == "cuda" and plan.host.type == "cpu"   # pinned pages make the copies async
    return HostOffloadOptimizer(params, lambda masters: make_torch_optimizer(masters, cfg, layout), plan.host, pin)


def make_torch_optimizer(params: list, cfg, layout=None) -> torch.optim.Optimizer:
    """`cfg.optimizer` over `params`, stepping wherever they live (device, or host masters); `layout`
    ((count, options) per group, in order) splits them into parameter groups."""
    lr, decay = cfg.learning_rate, cfg.weight_decay
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    flat = params
    if layout is not None:
        starts = [sum(count for count, _ in layout[:i]) for i in range(len(layout))]
        params = [{"params": flat[start:start + count], **options} for start, (count, options) in zip(starts, layout)]
    if cfg.optimizer == "adamw":
        on_cpu = all(p.device.type == "cpu" for p in flat)
        kernel = {"fused": True} if on_cpu else {"foreach": True}
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=decay, **kernel)
    if cfg.optimizer in LOW_BIT:
        return low_bit_class(cfg.optimizer)(params, lr=lr, betas=betas, weight_decay=decay)
    if cfg.optimizer == "adafactor":
        # Factored second moments: optimizer memory ~ rows + cols instead of rows x cols.
        return torch.optim.Adafactor(params, lr=lr, weight_decay=decay)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=decay)


def loraplus_groups(model, params: list, cfg) -> list[dict]:
    """LoRA+ (Hayou et al. 2024) as PEFT's create_loraplus_optimizer groups the trainable parameters of
    `model`: A matrices (and whatever else trains, a head's weight) at the learning rate; B matrices and
    1-D tensors (DoRA magnitudes, biases) at `loraplus_lr_ratio` times it, biases and LayerNorm weights
    without weight decay; LoRA on embeddings at PEFT's embedding rate (1e-6; mudpuppy adapts linear
    layers only, so this group is empty). Each group carries "lr_ratio", its rate over the schedule's."""
    from peft.tuners.lora.layer import Embedding

    if model is None:
        raise MudpuppyError("training.loraplus_lr_ratio: LoRA+ groups the parameters by name and needs the model")
    stepped = {id(p) for p in params}
    norms = {name for name, mod in model.named_modules() if isinstance(mod, torch.nn.LayerNorm)}
    ratio, decay = cfg.loraplus_lr_ratio, cfg.weight_decay
    groups = {"a": [], "embedding": [], "b": [], "b_no_decay": []}
    for name, param in model.named_parameters():
        if id(param) not in stepped:
            continue
        owner = ".".join(name.split(".")[:-2])
        if owner and isinstance(model.get_submodule(owner), Embedding):
            groups["embedding"].append(param)
        elif "lora_B" in name or param.ndim == 1:
            no_decay = "bias" in name or name.rpartition(".")[0] in norms
            groups["b_no_decay" if no_decay else "b"].append(param)
        else:
            groups["a"].append(param)
    if sum(map(len, groups.values())) != len(params):
        raise MudpuppyError("training.loraplus_lr_ratio: some trainable parameters are not the model's own")
    return [{"params": groups["a"], "weight_decay": decay, "lr_ratio": 1.0},
            {"params": groups["embedding"], "weight_decay": decay,
             "lr_ratio": LORAPLUS_EMBEDDING_LR / cfg.learning_rate},
            {"params": groups["b"], "weight_decay": decay, "lr_ratio": ratio},
            {"params": groups["b_no_decay"], "weight_decay": 0.0, "lr_ratio": ratio}]


def state_order(optimizer, params: list) -> list[int]:
    """For each of `params`, its index in `optimizer.state_dict()["state"]` (torch numbers parameters group
    by group, so LoRA+'s groups number them in another order than the model's)."""
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    return [index[id(p)] for p in params]


@functools.cache
def low_bit_class(name: str) -> type:
    """torchao's AdamW8bit / AdamW4bit, taught to accept the float lr the trainer assigns."""
    try:
        import torchao.optim as ao_optim
    except ImportError as exc:
        raise MudpuppyError(f"training.optimizer: {name} needs torchao.optim, which failed to import ({exc}); "
                            f"install or upgrade it with {TORCHAO_INSTALL}, or use adamw") from exc
    base = getattr(ao_optim, LOW_BIT[name])

    class LowBitAdamW(base):
        def step(self, closure=None):
            # torchao keeps lr as a tensor (a float would recompile the update) and refuses a float.
            for group in self.param_groups:
                if not torch.is_tensor(group["lr"]):
                    group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
            return super().step(closure)

    LowBitAdamW.__name__ = LowBitAdamW.__qualname__ = base.__name__
    return LowBitAdamW


def uses_torchao_offload(params: list, cfg, plan) -> bool:
    """Whether torchao's CPUOffloadOptimizer can stand in for HostOffloadOptimizer."""
    return (plan.device.type == "cuda" and plan.host.type == "cpu"   # it asserts CUDA (ROCm is cuda)
            and cfg.optimizer == "adamw"
            and cfg.max_grad_norm is None           # its gradients leave during backward, before clipping,
            and not plan.loss_scaling               # ... and before GradScaler.unscale_
            and all(p.dtype == torch.float32 for p in params)   # its host copies keep the param dtype
            and importlib.util.find_spec("torchao") is not None
            and (_torchao_version() or TORCHAO_MIN) >= TORCHAO_MIN)


def _torchao_offload(params: list, cfg):
    from torchao.optim import CPUOffloadOptimizer

    class TorchaoOffload(CPUOffloadOptimizer):
        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)
            # Its host copies were taken when it was built, before state.py restored the
            # weights; left stale, the next step would write the old weights back.
            with torch.no_grad():
                for p_device, p_host in self.param_d2h_map.items():
                    p_host.copy_(p_device.detach())

    # Defaults: fused CPU AdamW on the host; tensors under 4096 values stay on the device.
    return TorchaoOffload(params, torch.optim.AdamW, lr=cfg.learning_rate,
                          betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay)


# ------------------------------------------------------------------ host offload

class HostOffloadOptimizer:
    """ZeRO-Offload on one device: fp32 master weights and the optimizer state in host memory.

    Gradients stay on the device through backward, so clipping and GradScaler see them;
    step() copies them to the host, steps `inner` over the masters there, and copies the new
    values back. `param_groups` lists the device parameters (GradScaler unscales their
    gradients) and holds the hyperparameters, handed to the inner optimizer at each step.
    """

    def __init__(self, params: list, make_inner, host: torch.device, pin: bool = False):
        self.params = list(params)
        self.pin = pin
        # Separate host tensors even when host == device (CPU tests exercise real copies).
        self.masters = [self._host_tensor(p, host).copy_(p.detach()) for p in self.params]
        self.host_grads = [self._host_tensor(p, host) for p in self.params]
        self.inner = make_inner(self.masters)
        device_of = {id(m): p for m, p in zip(self.masters, self.params)}
        self.param_groups = [{**group, "params": [device_of[id(m)] for m in group["params"]]}
                             for group in self.inner.param_groups]

    def _host_tensor(self, param, host) -> torch.Tensor:
        return torch.empty(param.shape, dtype=torch.float32, device=host, pin_memory=self.pin)

    @property
    def state(self) -> dict:
        """The inner optimizer's state, keyed by device parameter."""
        return {p: self.inner.state[m] for p, m in zip(self.params, self.masters) if m in self.inner.state}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._pass_hyperparameters()
        stepped = self._gradients_to_host()
        self._wait()              # the host reads the gradients only once they have arrived
        self.inner.step()
        for param, master in stepped:
            param.copy_(master, non_blocking=self.pin)
        self._wait()              # the next step rewrites the masters: these copies must be done
        return loss

    def _gradients_to_host(self) -> list:
        stepped = []
        for param, master, grad in zip(self.params, self.masters, self.host_grads):
            # Like torch's optimizers, a parameter without a gradient keeps its value and state.
            master.grad = None if param.grad is None else grad.copy_(param.grad, non_blocking=self.pin)
            if master.grad is not None:
                stepped.append((param, master))
        return stepped

    def _wait(self) -> None:
        if self.pin:
            torch.cuda.synchronize(self.params[0].device)

    def _pass_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    def state_dict(self) -> dict:
        """The inner optimizer's state dict (the same layout as without offload), plus the
        masters of non-fp32 parameters: their device copies are rounded, so only the
        checkpoint can give the masters back exactly."""
        self._pass_hyperparameters()
        state = self.inner.state_dict()
        rounded = {i: m for i, (p, m) in enumerate(zip(self.params, self.masters)) if p.dtype != torch.float32}
        return {**state, "host_masters": rounded} if rounded else state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Call once the model's weights are restored (state.py does): the masters restart from them."""
        self.inner.load_state_dict({k: v for k, v in state.items() if k != "host_masters"})
        for param, master in zip(self.params, self.masters):
            master.copy_(param.detach())
        for index, master in state.get("host_masters", {}).items():
            self.masters[index].copy_(master)
        # The inner optimizer now has new group dicts: carry their hyperparameters out.
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            outer.update({k: v for k, v in inner.items() if k != "params"})
