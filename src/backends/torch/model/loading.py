"""Loading a transformers model at its storage precision, tensor by tensor, straight onto its device.

`transformers.from_pretrained` would do most of this, but two things it
cannot: quantize each linear layer as its weights are read (QLoRA), and keep
frozen layers in host memory while the rest goes to the GPU (streaming)
without `device_map`, which mudpuppy never uses (it segfaults on ROCm with an
integrated GPU present). So the model is built on the meta device, and every
tensor of the safetensors checkpoint is read with plain file reads (no mmap:
mapped pages of a 16 GB file would count against the process like a second
copy of the model), converted to its storage dtype, and placed:

    frozen linear, QLoRA            -> quantized on the device, 4-bit codes kept
    frozen linear, streamed         -> host memory (pinned on a GPU), visits the device per use
    everything else                 -> the device, in the storage dtype

Peak memory is the model as stored plus one tensor in flight. Checkpoints
this reader cannot map one to one onto the model (.bin files, renamed keys,
architectures whose weights transformers converts while loading) go through
`from_pretrained` at the storage dtype instead, and are quantized or
streamed layer by layer afterwards: still no fp32 copy, but the peak is the
model at its storage precision; the load report says which path ran.
"""

from __future__ import annotations

import contextlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ....errors import MudpuppyError
from .attention import choose_attention
from .experts import per_expert_layout
from .frozen import FrozenLinear
from ..quantization.qat.files import is_qat_checkpoint, load_quantized
from ..quantization.gptq.linear import gptq_settings_of, install_gptq_layers

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int               # absolute byte offset in the file
    nbytes: int


@dataclass
class FrozenPlan:
    """Which frozen linear layers become what while loading."""

    names: set[str] = field(default_factory=set)   # qualified module names
    build: object = None     # (name, weight, bias) -> nn.Module replacing the linear
    compact_keys: set[str] = field(default_factory=set)   # other tensors kept in `compact_dtype`
    compact_dtype: torch.dtype | None = None
    as_stored: set[str] = field(default_factory=set)      # read in the checkpoint's own dtype (GPTQ scales)
    params: set[str] = field(default_factory=set)          # other frozen tensors stored their own way (4-bit experts)
    build_param: object = None    # (key, tensor at the storage dtype on the device) -> nn.Parameter replacing it

    def dtype_of(self, key: str, dtype: torch.dtype) -> torch.dtype | None:
        if key in self.as_stored:
            return None
        return self.compact_dtype if key in self.compact_keys else dtype


@dataclass
class LoadReport:
    path: str                # "streamed" (tensor by tensor), "transformers" (from_pretrained, then converted)
                             # or "mudpuppy_qat" (a converted QAT model)
    dtype: torch.dtype
    tensors: int = 0
    new_keys: list[str] = field(default_factory=list)   # initialised, not read (a new scalar head)
    attention: str = ""      # the attention implementation chosen (attention.choose_attention)

    def describe(self) -> str:
        how = {"streamed": "tensor by tensor",
               "mudpuppy_qat": "as a converted QAT model (integer codes and scales, as stored)"}.get(
            self.path, "through transformers.from_pretrained (checkpoint not readable tensor by tensor)")
        attention = f", {self.attention} attention" if self.attention else ""
        return f"loaded {how} at {str(self.dtype).removeprefix('torch.')}{attention}"


# --------------------------------------------------------------------------- safetensors, without mmap


def checkpoint_files(directory: Path) -> list[Path] | None:
    """The safetensors files of a model directory, or None when it has none."""
    index = directory / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / name for name in names]
    single = directory / SINGLE_FILE
    return [single] if single.is_file() else None


def checkpoint_keys(directory: Path) -> set[str]:
    """The tensor names of a model directory's safetensors files."""
    keys: set[str] = set()
    for path in checkpoint_files(directory) or []:
        keys |= read_header(path).keys()
    return keys


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of a safetensors file: dtype, shape and where its bytes are."""
    from ....files import check_safetensors

    check_safetensors(path)     # a header claiming 2^40 bytes, or offsets past the end: one message, not MemoryError
    with path.open("rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    base = 8 + size
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in SAFETENSORS_DTYPES:
            raise MudpuppyError(f"{path}: tensor {name} has dtype {meta['dtype']}, which mudpuppy cannot read")
        begin, end = meta["data_offsets"]
        entries[name] = TensorEntry(path, SAFETENSORS_DTYPES[meta["dtype"]], tuple(meta["shape"]), base + begin,
                                    end - begin)
    return entries


def read_entry(entry: TensorEntry) -> torch.Tensor:
    with entry.file.open("rb", buffering=0) as fh:
        return read_tensor(fh, entry)


def read_tensor(fh, entry: TensorEntry) -> torch.Tensor:
    """One tensor into fresh host memory with a plain read: the page cache holds the file, not this process."""
    raw = torch.empty(entry.nbytes, dtype=torch.uint8)
    fh.seek(entry.start)
    view = memoryview(raw.numpy())
    while view.nbytes:
        got = fh.readinto(view)
        if not got:
            raise MudpuppyError(f"{entry.file}: the file ends inside a tensor; it is truncated or corrupt")
        view = view[got:]
    return raw.view(entry.dtype).reshape(entry.shape)


# --------------------------------------------------------------------------- the model


def storage_dtype(requested: str, compute: torch.dtype | None, trains_in_full: bool) -> torch.dtype:
    """What the weights are held in. `auto`: the compute dtype for a frozen base (nothing to gain from
    keeping more bits than the matmuls read), fp32 where weights train in full (they need fp32 master weights)."""
    if requested != "auto":
        return getattr(torch, requested)
    if trains_in_full or compute is None:
        return torch.float32
    return compute


def compact_dtype(directory: Path) -> torch.dtype | None:
    """The checkpoint's own 16-bit dtype (from config.json), or None when it is stored in 32 bits."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name)


def build_empty(auto_class: str, config, dtype: torch.dtype, trust_remote_code: bool):
    """The model's modules with parameters on the meta device; buffers (rotary tables) are real."""
    import transformers
    from accelerate import init_empty_weights

    # SDPA where transformers supports it for this model, else eager (attention.choose_attention).
    with init_empty_weights(include_buffers=False):
        return getattr(transformers, auto_class).from_config(
            config, dtype=dtype, attn_implementation=choose_attention(auto_class, config),
            trust_remote_code=trust_remote_code)


def load_weights(model: nn.Module, directory: Path, dtype: torch.dtype, device: torch.device,
                 frozen: FrozenPlan, new_modules: tuple[str, ...]) -> LoadReport | None:
    """Read every checkpoint tensor into the meta-built `model`; None when the checkpoint does not map
    one to one onto it (then the caller falls back to from_pretrained)."""
    files = checkpoint_files(directory)
    if files is None:
        return None
    entries: dict[str, TensorEntry] = {}
    for path in files:
        entries.update(read_header(path))
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    expected = set(model.state_dict().keys())
    # Experts stored one by one (the hub's Qwen3-MoE, Mixtral): each fused stack is built from its
    # experts' tensors, one stack at a time (experts.per_expert_layout).
    renamed, fused = per_expert_layout(getattr(model.config, "model_type", ""), expected - entries.keys(),
                                       set(entries))
    entries.update({key: entries[name] for key, name in renamed.items()})
    if any(len(parts) != model.get_parameter(key).shape[0] for key, parts in fused.items()):
        return None
    missing = expected - entries.keys() - fused.keys()
    new = sorted(k for k in missing - tied if k.split(".")[0] in new_modules)
    if missing - tied - set(new):
        return None            # renamed or converted keys: transformers knows how to map them
    report = LoadReport("streamed", dtype, new_keys=new)
    by_file: dict[Path, list[str]] = {}
    for key in sorted(expected & entries.keys(), key=lambda k: entries[k].start):
        by_file.setdefault(entries[key].file, []).append(key)
    pending_bias: dict[str, torch.Tensor] = {}
    for path, keys in by_file.items():
        with path.open("rb", buffering=0) as fh:
            for key in keys:
                tensor = read_tensor(fh, entries[key])
                place_tensor(model, key, tensor, dtype, device, frozen, pending_bias)
                report.tensors += 1
    for key, experts in sorted(fused.items()):
        stack = torch.stack([torch.cat([cast(read_entry(entries[name]), dtype) for name in parts])
                             for parts in experts])
        place_tensor(model, key, stack, dtype, device, frozen, pending_bias)
        report.tensors += sum(len(parts) for parts in experts)
        del stack
    finish_model(model, missing, new, device)
    return report


def place_tensor(model, key: str, tensor: torch.Tensor, dtype, device, frozen: FrozenPlan, pending: dict) -> None:
    module_name, _, leaf = key.rpartition(".")
    if module_name in frozen.names:
        # A frozen linear: build its replacement once the weight is here (the bias may come first or after).
        if leaf == "bias":
            if isinstance(model.get_submodule(module_name), FrozenLinear):
                set_tensor(model, key, cast(tensor, dtype).to(device))
            else:
                pending[module_name] = tensor
            return
        bias = pending.pop(module_name, None)
        bias = None if bias is None else cast(bias, dtype).to(device)
        model.set_submodule(module_name, frozen.build(module_name, tensor, bias))
        return
    if key in frozen.params:
        # A fused expert stack (QLoRA): quantized as it arrives, so the dense stack of one layer is the most
        # that ever exists at once.
        module = model.get_submodule(module_name)
        module._parameters[leaf] = frozen.build_param(key, cast(tensor, dtype).to(device))
        return
    set_tensor(model, key, cast(tensor, frozen.dtype_of(key, dtype)).to(device))


def cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Floating tensors to the storage dtype (None: as stored); integer and bool buffers as they are."""
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def set_tensor(model: nn.Module, key: str, value: torch.Tensor) -> None:
    module_name, _, leaf = key.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if leaf in module._parameters:
        old = module._parameters[leaf]
        trains = old.requires_grad if old is not None else False
        module._parameters[leaf] = nn.Parameter(value, requires_grad=trains)
    else:
        module._buffers[leaf] = value


def finish_model(model: nn.Module, missing: set[str], new: list[str], device: torch.device) -> None:
    """Tie shared weights, initialise new heads (in fp32: they train in full), move real buffers to the device."""
    model.tie_weights(missing_keys=missing, recompute_mapping=False)
    for _, param in model.named_parameters():
        if not param.is_meta:
            param._is_hf_initialized = True
    for key in new:
        module_name, _, leaf = key.rpartition(".")
        module = model.get_submodule(module_name)
        old = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(torch.empty(old.shape, dtype=torch.float32, device=device),
                                                requires_grad=old.requires_grad)
        module._is_hf_initialized = False    # from_config marked every module done; this one is not
    if new:
        model.initialize_weights()    # transformers' own init for what was not read, seeded by the run
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise MudpuppyError(f"loading left {len(left)} weights unset ({', '.join(left[:3])}); "
                            "the checkpoint does not match the model's configuration")


def load_pretrained_fallback(auto_class: str, directory: Path, dtype: torch.dtype, device: torch.device,
                             plan_frozen, trust_remote_code: bool, head_kwargs: dict, new_modules: tuple[str, ...]):
    """transformers' own loader at the storage dtype, then the frozen linears converted one by one."""
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(directory), trust_remote_code=trust_remote_code, **head_kwargs)
    model = getattr(transformers, auto_class).from_pretrained(
        str(directory), dtype=dtype, trust_remote_code=trust_remote_code,
        attn_implementation=choose_attention(auto_class, config), **head_kwargs)
    frozen = plan_frozen(model)
    for name in sorted(frozen.names):
        linear = model.get_submodule(name)
        model.set_submodule(name, frozen.build(name, linear.weight.data, linear.bias))
        del linear
    for key in sorted(frozen.params):
        module_name, _, leaf = key.rpartition(".")
        module = model.get_submodule(module_name)
        module._parameters[leaf] = frozen.build_param(key, module._parameters[leaf].data)
    for key in frozen.compact_keys:
        set_tensor(model, key, cast(model.get_parameter(key).data, frozen.compact_dtype))
    for name in new_modules:          # a new head trains in full: fp32, as on the tensor-by-tensor path
        if hasattr(model, name):
            getattr(model, name).to(torch.float32)
    model.to(device)
    return model, LoadReport("transformers", dtype)


def load_model_weights(auto_class: str, directory: Path, dtype: torch.dtype, device: torch.device,
                       plan_frozen, trust_remote_code: bool = False, head_kwargs: dict | None = None,
                       new_modules: tuple[str, ...] = ()):
    """The model of `directory` at `dtype` on `device`, frozen linears built by `plan_frozen(model)`.

    `new_modules` names top-level modules a checkpoint may lack (a new scalar
    head); they are initialised by transformers' own rules, under the run's seed.
    """
    from transformers import AutoConfig

    if is_qat_checkpoint(directory):
        return load_qat_checkpoint(auto_class, directory, dtype, device, trust_remote_code)
    config = AutoConfig.from_pretrained(str(directory), trust_remote_code=trust_remote_code, **(head_kwargs or {}))
    gptq = gptq_settings_of(directory)
    if gptq is not None:
        # A GPTQ checkpoint (quantization_config, quant_method gptq): its linears become GptqLinear
        # layers (quantization/gptq/linear.py) whose tensors are read as stored; transformers' own path would need
        # optimum and gptqmodel. The model in memory is then plain to transformers, so a merged or
        # re-saved model does not claim to be GPTQ.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
    model = build_empty(auto_class, config, dtype, trust_remote_code)
    as_stored = install_gptq_layers(model, checkpoint_keys(directory), gptq, dtype, str(directory)) if gptq else set()
    plan = plan_frozen(model)
    plan.as_stored = as_stored
    report = load_weights(model, directory, dtype, device, plan, new_modules)
    if report is None and gptq is not None:
        raise MudpuppyError(f"{directory}: this GPTQ checkpoint's tensors do not match the model its config.json "
                            "describes (renamed or missing keys); mudpuppy reads GPTQ checkpoints tensor by tensor only")
    if report is None:
        del model
        model, report = load_pretrained_fallback(auto_class, directory, dtype, device, plan_frozen,
                                                 trust_remote_code, head_kwargs or {}, new_modules)
    report.attention = getattr(model.config, "_attn_implementation", None) or ""
    return model, report


def load_qat_checkpoint(auto_class: str, directory: Path, dtype: torch.dtype, device: torch.device,
                        trust_remote_code: bool):
    """A converted QAT model (quant_method mudpuppy_qat): its linears are QuantizedLinear layers holding
    the integer codes, read as stored. transformers alone would skip the unknown quantization_config and
    leave those layers randomly initialised, so this is the only way in; it serves inference (eval, chat,
    serve, export), not further training on the codes."""
    if auto_class != "AutoModelForCausalLM":
        raise MudpuppyError(f"{directory}: a converted QAT model is a causal LM; it cannot be loaded as "
                            f"{auto_class} (a reward model's base)")
    return load_quantized(directory, device, dtype, trust_remote_code), LoadReport("mudpuppy_qat", dtype)


@contextlib.contextmanager
def quiet_if(quiet: bool):
    """transformers' loading messages silenced while `quiet`."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    if quiet:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)
