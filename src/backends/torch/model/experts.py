"""Mixture-of-experts models: their fused expert tensors, routers, 4-bit storage and auxiliary loss.

transformers 5 holds the experts of Qwen3-MoE, Mixtral, gpt-oss (and OLMoE, Qwen2-MoE,
DeepSeek-V3, ...) as one module per layer with 3-D parameters, ``experts.gate_up_proj``
``[experts, 2 * intermediate, hidden]`` and ``experts.down_proj`` (gpt-oss stores them
transposed, ``[experts, in, out]``). They are not ``nn.Linear``: PEFT's ``all-linear``
never reaches them, and they are most of the model's weights. So:

- `find_moe` finds them (and each layer's router) from the model's modules, not from a
  list of family names: a module with 3-D parameters whose first dimension is its
  ``num_experts``; the router is the sibling whose weight has one row per expert.
- LoRA reaches them through PEFT's ``target_parameters`` (``lora.ParamWrapper``: one
  rank-r pair per expert, folded into the stack for each forward, merged by
  ``merge_and_unload``, saved and loaded back by plain PEFT).
- QLoRA stores them as `PackedExperts`: a tensor subclass holding 4-bit codes
  (quant_formats) that stands where the parameter stood. Reading one expert
  (``stack[i]``, ``stack[ids]``) dequantizes that expert only; any other operation
  (``grouped_mm`` on the whole stack, PEFT's ``W + scale * B @ A`` fold) sees the
  dequantized stack, built for that one operation and dropped with it.
- `router_aux_loss` is the load-balancing term the model's own forward adds to its loss
  when ``config.output_router_logits`` is set, computed by the model module's own
  ``load_balancing_loss_func``.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..quantization.formats import check_group_size, check_quant_backend, dequantize_weight, quantize_weight

logger = logging.getLogger(__name__)
GROUPS = ("attention", "mlp", "experts", "router")
BF16_BYTES = 2


@dataclass
class MoeLayout:
    """Where a model keeps its experts and routers (qualified module names)."""

    experts: dict[str, tuple[str, ...]] = field(default_factory=dict)   # module -> its 3-D parameter names
    routers: list[str] = field(default_factory=list)

    def parameter_keys(self) -> list[str]:
        """Qualified names of the fused expert tensors (``model.layers.0.mlp.experts.gate_up_proj``)."""
        return [f"{module}.{name}" for module, names in self.experts.items() for name in names]

    def target_names(self) -> set[str]:
        """PEFT ``target_parameters`` names: the experts module's leaf name and the tensor's (``experts.down_proj``)."""
        return {f"{module.rpartition('.')[2]}.{name}" for module, names in self.experts.items() for name in names}

    def router_names(self) -> list[str]:
        """PEFT ``modules_to_save`` names for the routers: parent and leaf (``mlp.gate``), which match no other module."""
        return sorted({".".join(name.split(".")[-2:]) for name in self.routers})


def find_moe(model: nn.Module) -> MoeLayout:
    """The fused expert modules and the routers beside them; an empty layout for a dense model."""
    layout = MoeLayout()
    for name, module in model.named_modules():
        experts = getattr(module, "num_experts", None)
        if not isinstance(experts, int):
            continue
        stacked = tuple(key for key, p in module.named_parameters(recurse=False)
                        if p.ndim == 3 and p.shape[0] == experts)
        if not stacked:
            continue
        layout.experts[name] = stacked
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        for child_name, child in parent.named_children():
            if child is module:
                continue
            weight = getattr(child, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.shape[0] == experts:
                layout.routers.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return layout


def group_of(key: str, layout: MoeLayout) -> str | None:
    """Which target group a weight belongs to (by its qualified name in the base model), or None for
    embeddings, norms and the output head."""
    module = key.rpartition(".")[0]
    if key in layout.parameter_keys() or module in layout.experts:
        return "experts"
    if module in layout.routers:
        return "router"
    parts = key.split(".")
    if "layers" not in parts and "h" not in parts and "blocks" not in parts:
        return None
    if "experts" in parts:
        return "experts"          # per-expert linears (a ModuleList of MLPs)
    if any("attn" in p or "attention" in p for p in parts):
        return "attention"
    if any(p in ("mlp", "feed_forward", "ffn", "block_sparse_moe") or "mlp" in p for p in parts):
        return "mlp"
    return None


def weight_sizes(model: nn.Module):
    """(qualified name, elements, requires grad) of each weight matrix or expert stack, frozen layers that keep
    their weight outside a parameter (4-bit, compact, streamed) included."""
    from .frozen import FrozenLinear

    for name, module in model.named_modules():
        if isinstance(module, FrozenLinear) and not module.tied:
            yield f"{name}.weight", module.in_features * module.out_features, False
        for key, param in module.named_parameters(recurse=False):
            if param.ndim >= 2 and not key.endswith("bias"):     # gpt-oss's expert biases are [experts, out]
                yield f"{name}.{key}" if name else key, param.numel(), param.requires_grad


def base_weight_groups(model: nn.Module, layout: MoeLayout) -> dict[str, int]:
    """Weights (matrices and expert stacks, not norms or biases) per group, in elements."""
    counts = dict.fromkeys(GROUPS, 0)
    for key, size, _ in weight_sizes(model):
        group = group_of(key, layout)
        if group is not None:
            counts[group] += size
    return counts


def full_groups(model: nn.Module, layout: MoeLayout) -> dict[str, dict[str, int]]:
    """`adapter_groups` for full fine-tuning: each trainable weight trains itself."""
    out = {g: {"params": 0, "adapted": 0, "trainable": 0} for g in GROUPS}
    for key, size, trains in weight_sizes(model):
        group = group_of(key, layout)
        if group is not None:
            out[group]["params"] += size
            out[group]["adapted"] += size if trains else 0
            out[group]["trainable"] += size if trains else 0
    return {g: counts for g, counts in out.items() if counts["params"]}


def warn_if_mostly_unadapted(groups: dict[str, dict[str, int]]) -> None:
    """One warning line when the adapter reaches less than half of the decoder's weights (e.g. attention only,
    on a mixture-of-experts model whose experts hold most of them)."""
    body = [g for g in ("attention", "mlp", "experts") if g in groups]
    total = sum(groups[g]["params"] for g in body)
    covered = sum(groups[g]["adapted"] for g in body)
    if not total or covered * 2 >= total:
        return
    left = max((g for g in body), key=lambda g: groups[g]["params"] - groups[g]["adapted"])
    share = (groups[left]["params"] - groups[left]["adapted"]) / total
    hint = ("target_modules: all-linear adapts the experts too" if left == "experts"
            else "target_modules: all-linear adapts every linear layer")
    logger.warning("adapter: reaches %.0f%% of the decoder's weights; %s hold %.0f%% without an adapter (%s)",
                   100 * covered / total, left, 100 * share, hint)


def adapter_groups(model: nn.Module, layout: MoeLayout, base_counts: dict[str, int]) -> dict[str, dict[str, int]]:
    """Per group: its base weights (``params``), how many of them carry an adapter (``adapted``), and the
    trainable parameters that adapt or replace them (``trainable``). `model` is the transformers model
    (PEFT's layers injected in it)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    out = {g: {"params": base_counts.get(g, 0), "adapted": 0, "trainable": 0} for g in GROUPS}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            base = strip_wrappers(name)
            parameter = getattr(module, "parameter_name", None)
            key = f"{base}.{parameter}" if parameter else f"{base}.weight"
            group = group_of(key, layout)
            if group is None:
                continue
            own = [p for attr in ("lora_A", "lora_B") for p in getattr(module, attr).parameters() if p.requires_grad]
            out[group]["trainable"] += sum(p.numel() for p in own)
            if parameter:
                out[group]["adapted"] += module.get_param().numel()
            else:     # in x out from the layer, not its weight: a 4-bit layer would rebuild it to be read
                out[group]["adapted"] += module.in_features * module.out_features
        elif isinstance(module, ModulesToSaveWrapper):
            group = group_of(f"{strip_wrappers(name)}.weight", layout)
            if group is not None:
                trained = [p for p in module.modules_to_save.parameters() if p.requires_grad]
                out[group]["trainable"] += sum(p.numel() for p in trained)
                out[group]["adapted"] += sum(p.numel() for p in trained if p.ndim >= 2)
    return {g: counts for g, counts in out.items() if counts["params"]}


def strip_wrappers(name: str) -> str:
    return ".".join(p for p in name.split(".") if p != "base_layer")


# --------------------------------------------------------------------------- per-expert checkpoints

# model_type -> (checkpoint renames, fused leaf -> the per-expert linears concatenated into it, in order): what
# transformers 5's conversion_mapping does for checkpoints that store each expert as its own linear layers
# (the hub's Qwen3-MoE and Mixtral), so they stream tensor by tensor instead of loading dense first.
PER_EXPERT = {
    "qwen2_moe": ((), {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}),
    "qwen3_moe": ((), {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}),
    "mixtral": (((".block_sparse_moe.", ".mlp."),), {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),
}


def per_expert_layout(model_type: str, missing: set[str], names: set[str]) -> tuple[dict, dict]:
    """For a checkpoint of `names` that stores experts one by one: ({model key: checkpoint key} for the
    tensors it names otherwise, {fused model key: [[checkpoint keys concatenated along rows] per expert]})
    for the `missing` fused stacks it can build; ({}, {}) for any other family."""
    if model_type not in PER_EXPERT:
        return {}, {}
    renames, parts = PER_EXPERT[model_type]

    def model_key(name: str) -> str:
        for old, new in renames:
            name = name.replace(old, new)
        return name

    by_model = {model_key(n): n for n in names}
    renamed = {m: n for m, n in by_model.items() if m != n}
    fused = {}
    for key in missing:
        prefix, _, leaf = key.rpartition(".")
        if leaf not in parts or not prefix.endswith(".experts"):
            continue
        experts = []
        while all(f"{prefix}.{len(experts)}.{src}.weight" in by_model for src in parts[leaf]):
            experts.append([by_model[f"{prefix}.{len(experts)}.{src}.weight"] for src in parts[leaf]])
        if experts:
            fused[key] = experts
    return renamed, fused


# --------------------------------------------------------------------------- the auxiliary loss


def load_balancing_function(model: nn.Module):
    """The model module's own ``load_balancing_loss_func``, or None for a model without one."""
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def adds_router_aux_loss(model: nn.Module) -> bool:
    """Whether the model's forward adds the router's load-balancing loss to its loss: when its config asks
    for router logits (``output_router_logits``) and it has the coefficient and the function."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "output_router_logits", False) and hasattr(model, "router_aux_loss_coef")
                and load_balancing_function(model) is not None)


def router_aux_loss(model: nn.Module, router_logits, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)``,
    exactly as the model's forward computes it."""
    config = model.config
    experts = getattr(model, "num_experts", None) or getattr(config, "num_experts", None) or config.num_local_experts
    top_k = getattr(model, "num_experts_per_tok", None) or config.num_experts_per_tok
    aux = load_balancing_function(model)(router_logits, experts, top_k, attention_mask)
    if not isinstance(aux, torch.Tensor):     # no router logits: the function returns 0
        return torch.zeros((), dtype=torch.float32)
    return model.router_aux_loss_coef * aux.float()


def batch_router_aux_loss(model: nn.Module, outputs, batch, device: torch.device) -> torch.Tensor:
    """router_aux_loss of one forward's `outputs` (asked for with ``output_router_logits``), with the
    batch's own [B, T] attention mask, as the model computes it (a packed batch's 4-D mask is for
    attention only)."""
    mask = getattr(batch, "attention_mask", None)
    mask = torch.as_tensor(mask, device=device) if mask is not None and np.ndim(mask) == 2 else None
    return router_aux_loss(model, getattr(outputs, "router_logits", None), mask).to(device)


def set_router_aux_loss(model: nn.Module, coefficient: float) -> None:
    """`model.router_aux_loss_coef` from the run's config: the model's forward (and ours) add the
    load-balancing loss with this weight, or not at all at 0 (routing.router_aux_coefficient)."""
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.output_router_logits = coefficient > 0
        config.router_aux_loss_coef = coefficient
    if hasattr(model, "router_aux_loss_coef"):
        model.router_aux_loss_coef = coefficient


# --------------------------------------------------------------------------- 4-bit expert stacks


class PackedExperts(torch.Tensor):
    """A frozen ``[experts, rows, cols]`` stack held as 4-bit codes, dequantized where it is read.

    The codes are `quant_formats.quantize_weight`'s for the stack seen as ``[experts * rows, cols]``
    (groups run along the last dimension), so each expert's codes are a contiguous block of rows.
    Its dtype is the dtype it dequantizes to; it never requires grad.
    """

    @staticmethod
    def __new__(cls, tensors: dict[str, torch.Tensor], quant_backend: str, shape, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype,
                                                   device=tensors["qweight"].device, requires_grad=False)

    def __init__(self, tensors, quant_backend, shape, dtype):
        self.codes = dict(tensors)
        self.quant_backend = quant_backend

    @classmethod
    def from_dense(cls, weight: torch.Tensor, quant_backend: str = "int4", group_size: int | None = 64):
        experts, rows, cols = weight.shape
        with torch.no_grad():
            tensors = quantize_weight(weight.detach().reshape(experts * rows, cols), quant_backend, group_size)
        return cls(tensors, quant_backend, weight.shape, weight.dtype)

    def dequantize(self, dtype: torch.dtype | None = None, experts=None) -> torch.Tensor:
        """The dense stack in `dtype` (default: its own), or only `experts` (an int or an index tensor)."""
        count, rows, cols = self.shape
        codes = self.codes
        lead: tuple = (count,)
        if experts is not None:
            picked = {k: v.view(count, rows, *v.shape[1:])[experts] for k, v in codes.items()}
            lead = tuple(picked["qweight"].shape[:-2])
            codes = {k: v.reshape(-1, *v.shape[-1:]) for k, v in picked.items()}
        dense = dequantize_weight(codes, self.quant_backend, cols, dtype or self.dtype)
        return dense.view(*lead, rows, cols)

    def quantized_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.codes.values())

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"PackedExperts(shape={tuple(self.shape)}, dtype={self.dtype}, {self.quant_backend}, "
                f"{self.quantized_bytes()} bytes)")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        me = args[0] if args and isinstance(args[0], PackedExperts) else None
        if me is not None:
            if func in (aten.detach.default, aten.alias.default):
                return PackedExperts(me.codes, me.quant_backend, me.shape, me.dtype)
            if func is aten.select.int and args[1] == 0:
                return me.dequantize(experts=args[2])
            if func is aten.index.Tensor and len(args[1]) == 1 and args[1][0] is not None:
                return me.dequantize(experts=args[1][0])
            if func is aten._to_copy.default and set(kwargs) <= {"dtype", "device", "non_blocking"}:
                device = kwargs.get("device") or me.device
                codes = {k: v.to(device, non_blocking=kwargs.get("non_blocking", False)) for k, v in me.codes.items()}
                return PackedExperts(codes, me.quant_backend, me.shape, kwargs.get("dtype") or me.dtype)
        # Anything else reads the whole stack: dequantize it for this one operation.
        dense = tree_map(lambda a: a.dequantize() if isinstance(a, PackedExperts) else a, (args, kwargs))
        return func(*dense[0], **dense[1])

    __torch_function__ = torch._C._disabled_torch_function_impl


@dataclass(frozen=True)
class ExpertsReport:
    tensors: int
    bytes_before: int     # as bf16
    bytes_after: int

    def summary(self) -> str:
        return (f"{self.tensors} expert tensors {self.bytes_before / 2**20:.1f} MiB as bf16 -> "
                f"{self.bytes_after / 2**20:.1f} MiB")


def packed_parameter(weight: torch.Tensor, quant_backend: str, group_size: int | None) -> nn.Parameter:
    """`weight` (an expert stack, on its compute device) as a frozen parameter holding 4-bit codes."""
    return nn.Parameter(PackedExperts.from_dense(weight, quant_backend, group_size), requires_grad=False)


def quantize_experts(model: nn.Module, quant_backend: str = "int4", group_size: int | None = 64) -> ExpertsReport:
    """Replace every fused expert tensor of `model` (in memory) by its 4-bit `PackedExperts`."""
    check_quant_backend(quant_backend)
    check_group_size(group_size)
    for key in find_moe(model).parameter_keys():
        module_name, _, leaf = key.rpartition(".")
        module = model.get_submodule(module_name)
        if not isinstance(module._parameters[leaf], PackedExperts):
            module._parameters[leaf] = packed_parameter(module._parameters[leaf].data, quant_backend, group_size)
    return summarize_experts(model)


def summarize_experts(model: nn.Module) -> ExpertsReport:
    stacks = [p for p in model.parameters() if isinstance(p, PackedExperts)]
    return ExpertsReport(len(stacks), sum(p.numel() * BF16_BYTES for p in stacks),
                         sum(p.quantized_bytes() for p in stacks))


def densify_experts(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Replace each `PackedExperts` parameter by a plain frozen parameter of its dequantized values (what
    the adapter trained against), so that a merge can write into it. Returns how many were replaced."""
    replaced = 0
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, PackedExperts):
                module._parameters[name] = nn.Parameter(param.dequantize(dtype), requires_grad=False)
                replaced += 1
    return replaced
