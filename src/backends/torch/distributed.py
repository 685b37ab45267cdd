"""Training on several processes with torch.distributed: DDP, FSDP2, and sharded checkpoints.

A distributed run is N copies of `mudpuppy run` started by torchrun (or by
`mudpuppy run --nproc N`, which calls the same launcher). This module joins
the process group each copy was given and runs the engines torch ships; it
adds no communication of its own beyond one all-reduce of the step's counts.

- `join` starts the process group: gloo on the CPU, nccl on CUDA and on
  ROCm (where torch's nccl is RCCL) bound to the rank's own GPU, and installs
  the collectives the recipes use (distributed.py at the package root).
- `Engine` wraps the model for training. The recipes compute losses by
  calling pieces of the model (the decoder, then the output head in chunks),
  not its forward, so both engines wrap a `Step` module whose forward runs
  whatever the trainer hands it: DDP's reducer and FSDP2's root hooks see one
  forward per micro-batch and one backward, as they expect.
  - ddp: `DistributedDataParallel`; micro-batches before the last of a step
    run under `no_sync()`, so gradients are averaged once per step.
  - fsdp: FSDP2 `fully_shard` on every decoder layer (the LoRA matrices live
    inside them, so they shard with their layer), then on the root; bf16
    parameters with fp32 reduction where the device computes in bf16;
    `CPUOffloadPolicy` on request. Evaluation and generation outside a step
    gather the root's parameters first (`gathered`).
- The loss of a step is divided by the number of loss units (tokens, pairs)
  of the whole global batch, all-reduced, and multiplied by the number of
  ranks to undo the engines' averaging: N ranks at micro batch b compute
  exactly the gradient of one process at micro batch N*b.
- Checkpoints are written with torch.distributed.checkpoint (DCP): each rank
  writes its shard, rank 0 the rest; they load into any number of processes,
  one included (state.py reads them back). DCP reads its `.metadata` with
  plain pickle and the non-tensor entries (optimizer hyperparameters) with
  torch.load(weights_only=False), either of which runs whatever a crafted file
  names; `load_sharded` reads both through allow-lists instead (SafeReader,
  SafePlanner), after checking the directory's files (files.check_dcp_dir).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from ... import distributed as ranks_module
from ...errors import MudpuppyError
from .handle import unwrap
from .safe_load import load_torch_file

DCP_DIR = "sharded"                     # inside a checkpoint: the DCP files
RNG_FILE = "rng-rank{rank}.pt"


def joined() -> bool:
    return dist.is_available() and dist.is_initialized()


def join(device_type: str, cfg) -> ranks_module.Ranks:
    """Join the process group the launcher set up (idempotent): this process's ranks, with the collectives."""
    ranks = ranks_module.from_environment()
    if ranks.world == 1:
        return ranks_module.Ranks()
    if not joined():
        backend = "gloo" if device_type == "cpu" else "nccl"      # nccl is RCCL on a ROCm build
        timeout = datetime.timedelta(seconds=cfg.timeout_s if cfg is not None else 600)
        # The rank's own GPU (devices.plan_run made it current): NCCL binds its communicator to it at once,
        # instead of guessing from the current device at the first collective.
        device = None if device_type == "cpu" else torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device)
        atexit.register(_leave)
    ranks.barrier = _barrier
    ranks.broadcast = _broadcast
    ranks.gather = _gather
    return ranks


def _leave() -> None:
    if joined():
        dist.destroy_process_group()


def _barrier() -> None:
    dist.barrier()


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class Step(torch.nn.Module):
    """The module the engines wrap: its forward runs the function it is given (one micro-batch's loss)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, fn):
        return fn()


class Engine:
    """One model wrapped for N processes; the trainer runs each micro-batch through `run`."""

    def __init__(self, strategy: str, model, plan, cfg, ranks: ranks_module.Ranks,
                 compute_dtype: torch.dtype | None = None):
        self.strategy = strategy
        self.ranks = ranks
        self.in_step = False
        self.step_module = Step(model)
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [plan.device.index] if plan.device.type == "cuda" else None
            # Buffers (rotary tables, 4-bit codes) are loaded identically on every rank: no broadcast per step.
            self.wrapped = DistributedDataParallel(self.step_module, device_ids=device_ids,
                                                   find_unused_parameters=False, broadcast_buffers=False)
        else:
            self.wrapped = shard_model(self.step_module, model, compute_dtype, cfg)

    @contextlib.contextmanager
    def micro_batch(self, sync: bool):
        """Around one micro-batch's forward and backward; `sync` False defers the gradient
        reduction to a later micro-batch of the same step (accumulation)."""
        if self.strategy == "ddp":
            with contextlib.nullcontext() if sync else self.wrapped.no_sync():
                yield
        else:
            self.wrapped.set_requires_gradient_sync(sync)
            yield

    def forward(self, fn):
        """fn() (a loss and its metrics) as the wrapped module's forward."""
        self.in_step = True
        try:
            return self.wrapped(fn)
        finally:
            self.in_step = False

    @contextlib.contextmanager
    def gathered(self):
        """FSDP: the root's parameters (embeddings, final norm, head) whole, for work outside a step
        (evaluation, generation, saving); the layers gather their own through their hooks."""
        if self.strategy != "fsdp" or self.in_step:
            yield
            return
        self.wrapped.unshard()
        try:
            yield
        finally:
            self.wrapped.reshard()

    def all_sum(self, values: list[float], device: torch.device) -> list[float]:
        """Each value summed over the ranks, in float64 (counts stay exact)."""
        t = torch.tensor(values, dtype=torch.float64, device=device if device.type != "cpu" else "cpu")
        dist.all_reduce(t)
        return t.tolist()

    def grad_norm(self, params, clip: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        if hasattr(norm, "full_tensor"):       # FSDP: a DTensor reduced over the shards
            norm = norm.full_tensor()
        return float(norm)


def shard_model(step_module, model, compute_dtype: torch.dtype | None, cfg):
    """FSDP2: each decoder layer a unit (with its LoRA matrices), the rest under the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    policy = mixed_precision(cfg.mixed_precision, compute_dtype)
    offload = CPUOffloadPolicy() if cfg.cpu_offload else None
    extra = {"offload_policy": offload} if offload is not None else {}
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy, **extra)
    return fully_shard(step_module, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy, **extra)


def mixed_precision(choice: str, compute_dtype: torch.dtype | None):
    """auto follows the run's compute dtype (training.precision resolved for the device), not the
    device's preference alone: a run that asked for fp32 on a bf16-native CPU stays fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = choice == "bf16" or (choice == "auto" and compute_dtype == torch.bfloat16)
    if bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model (the ModuleList holding most parameters)."""
    base = unwrap(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base
    lists = [m for m in decoder.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        raise MudpuppyError(f"distributed.strategy: fsdp found no decoder layers in {type(base).__name__} to shard")
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def fsdp_problem(adapter_type: str, plan, head: str | None = None) -> str | None:
    """Why this run cannot shard with FSDP2, or None."""
    if head is not None:
        return ("distributed.strategy: fsdp: a reward model is saved whole with its adapter merged in place, "
                "which needs the whole model on one rank; train reward models with strategy: ddp")
    if adapter_type == "qlora":
        return ("distributed.strategy: fsdp shards parameters, and QLoRA's 4-bit base is kept in buffers that "
                "FSDP2 would copy whole to every rank instead of sharding; use strategy: ddp for QLoRA "
                "(the 4-bit base fits each rank) or lora with fsdp")
    if plan.memory is not None and (plan.memory.stream_layers or plan.memory.optimizer_offload
                                    or plan.memory.activation_offload):
        return (f"distributed: {', '.join(plan.memory.requested())} are single-process memory options; under fsdp "
                "use distributed.cpu_offload (parameters, gradients and optimizer state in host memory)")
    return None


# ------------------------------------------------------------------ checkpoints
def save_sharded(handle, trainer, path: Path, rank: int) -> None:
    """Every rank writes its part with DCP (collective); each rank its own RNG; rank 0 the PEFT adapter."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    )

    options = StateDictOptions(ignore_frozen_params=True)
    state = {"model": get_model_state_dict(handle.model, options=options),
             "optim": get_optimizer_state_dict(handle.model, trainer.optimizer, options=options)}
    dcp.save(state, checkpoint_id=str(path / DCP_DIR))
    torch.save(trainer.runtime_state(), path / RNG_FILE.format(rank=rank))


def load_sharded(handle, trainer, path: Path, rank: int) -> None:
    """A DCP checkpoint into this process's model and optimizer, whatever the number of processes now."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
        set_optimizer_state_dict,
    )


    options = StateDictOptions(ignore_frozen_params=True)
    state = {"model": get_model_state_dict(handle.model, options=options),
             "optim": get_optimizer_state_dict(handle.model, trainer.optimizer, options=options)}
    load_dcp(state, path / DCP_DIR)      # every trainable tensor, or it raises
    # Not strict: the frozen base is not in the checkpoint, it comes from the model files.
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    set_model_state_dict(handle.model, state["model"], options=options)
    set_optimizer_state_dict(handle.model, trainer.optimizer, state["optim"], options=options)
    own = path / RNG_FILE.format(rank=rank)
    # A different number of processes: ranks beyond the saved ones continue from rank 0's RNG.
    rng = own if own.is_file() else path / RNG_FILE.format(rank=0)
    trainer.load_runtime_state(load_torch_file(rng))


def is_sharded(path: Path) -> bool:
    return (Path(path) / DCP_DIR).is_dir()


def load_dcp(state: dict, directory: Path) -> None:
    """dcp.load with nothing in the checkpoint able to run code: the directory checked first, its
    metadata unpickled through files.DCP_CLASSES, its non-tensor entries through weights_only."""
    import torch.distributed.checkpoint as dcp

    from ...files import check_dcp_dir

    check_dcp_dir(directory)
    try:
        dcp.load(state, checkpoint_id=str(directory), storage_reader=_safe_reader(directory),
                 planner=_safe_planner(directory))
    except dcp.api.CheckpointException as exc:
        # DCP gathers each rank's failure into one exception: ours (a refused file) by name, else its last line.
        causes = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        ours = [c for c in causes if isinstance(c, MudpuppyError)]
        if ours:
            raise ours[0] from None
        last = str(causes[0] if causes else exc).strip().splitlines()[-1]
        raise MudpuppyError(f"checkpoint {directory} does not load into this model and optimizer ({last}); "
                            "resume with the config that made it") from None


def _resolve_dcp_class(module: str, name: str):
    """The real class for a name files.DCP_CLASSES allows (the allow-list is checked before this is called)."""
    import importlib

    return getattr(importlib.import_module(module), name)


def _safe_reader(directory: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    from ...files import load_dcp_metadata

    class SafeReader(FileSystemReader):
        """FileSystemReader whose read_metadata unpickles through the allow-list (the rest as upstream's)."""

        def read_metadata(self, *args, **kwargs):
            metadata = load_dcp_metadata(self._get_metadata_path(kwargs.get("rank")), _resolve_dcp_class)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(directory))


def _safe_planner(directory: Path):
    import pickle

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from ...files import CorruptFile

    class SafePlanner(DefaultLoadPlanner):
        """Non-tensor entries are loaded with weights_only=True first: upstream's own load (weights_only=False)
        then only ever sees bytes that passed it."""

        def load_bytes(self, read_item, value):
            try:
                torch.load(value, weights_only=True)
            except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise CorruptFile(f"{directory}: entry {read_item.dest_index.fqn} refused ({first}); a file like "
                                  "this can run code when read, so it was not loaded") from None
            value.seek(0)
            super().load_bytes(read_item, value)

    return SafePlanner()


def full_state_dict(model, trainable_only: bool) -> dict:
    """The whole (unsharded) state on rank 0, in host memory; collective under FSDP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    state = get_model_state_dict(model, options=options)
    # A tied weight (the output head sharing the embedding) is saved once, as transformers saves it.
    unique = {name for name, _ in model.named_parameters()}
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - unique
    return {name: value for name, value in state.items() if name not in tied}
