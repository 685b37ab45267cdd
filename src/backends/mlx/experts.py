"""LoRA on mixture-of-experts experts (mlx-lm's SwitchGLU), exactly as PEFT's `target_parameters` adapts them.

transformers 5 holds each layer's experts as two fused tensors, ``mlp.experts.gate_up_proj``
(gate and up stacked along the output) and ``mlp.experts.down_proj``; the torch backend adapts
them with PEFT's ``lora.ParamWrapper``: ONE rank-r pair per expert on each tensor, so gate and up
share their A and take the two parts of one B. mlx-lm keeps gate, up and down as three
SwitchLinear stacks, and its LoRASwitchLinear would give gate and up a pair each (another
adapter). `LoRASwitchGLU` stands where the SwitchGLU stood, keeps its three stacks (frozen, at
their paths) and adds PEFT's two pairs:

- ``gate_up.lora_a`` [E, r, hidden], ``gate_up.lora_b`` [E, 2 * intermediate, r]: the fused output in
  transformers' order, which `SPLITS` gives per family (Qwen3-MoE, Mixtral: gate then up;
  gpt-oss: interleaved, gate at even rows);
- ``down.lora_a`` [E, r, intermediate], ``down.lora_b`` [E, hidden, r];

each delta is scale * B_e (A_e x) on the expert's input, the bias (gpt-oss) left as it is, as in
PEFT. No dropout and no DoRA on experts, as in PEFT. The router (an nn.Linear on MLX, not one on
torch) is never adapted.
"""

from __future__ import annotations

import math
import re

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_unflatten

# model_type -> (the experts module's path in a transformers 5 layer, how gate_up_proj's rows hold gate and up).
SPLITS = {"qwen3_moe": ("mlp.experts", "halves"), "mixtral": ("mlp.experts", "halves"),
          "gpt_oss": ("mlp.experts", "interleaved")}
TARGETS = ("experts.gate_up_proj", "experts.down_proj")   # PEFT's target_parameters names, as on torch
_LAYER = re.compile(r"^(.*?layers\.\d+)\.")


def is_glu(module) -> bool:
    from mlx_lm.models.switch_layers import SwitchGLU

    return isinstance(module, SwitchGLU)


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Path -> SwitchGLU (or its LoRA wrapper) for each mixture-of-experts layer."""
    return {p: m for p, m in model.named_modules() if is_glu(m) or isinstance(m, LoRASwitchGLU)}


def router_paths(model: nn.Module) -> set[str]:
    """The routers: each expert layer's nn.Linear sibling with one output per expert (never a LoRA target)."""
    out = set()
    modules = dict(model.named_modules())
    for path, glu in expert_modules(model).items():
        parent_path = path.rpartition(".")[0]
        parent = modules[parent_path]
        experts = glu.gate_proj.num_experts
        for name, child in parent.children().items():
            if isinstance(child, (nn.Linear, nn.QuantizedLinear)) and child.weight.shape[0] == experts:
                out.add(f"{parent_path}.{name}")
    return out


def torch_path(mlx_path: str, model_type: str) -> str:
    """The experts module's path in transformers (PEFT's adapter names it so) for an MLX SwitchGLU path."""
    layer = _LAYER.match(mlx_path + ".")
    return f"{layer.group(1)}.{SPLITS[model_type][0]}"


class ExpertPair(nn.Module):
    """One rank-r pair per expert: lora_a [E, r, in] (PEFT-style uniform init), lora_b [E, out, r] (zeros)."""

    def __init__(self, experts: int, in_dims: int, out_dims: int, r: int):
        super().__init__()
        bound = 1.0 / math.sqrt(in_dims)     # PEFT's kaiming_uniform_(a=sqrt(5)) on an [r*E, in] weight
        self.lora_a = mx.random.uniform(low=-bound, high=bound, shape=(experts, r, in_dims))
        self.lora_b = mx.zeros((experts, out_dims, r))

    def __call__(self, x, idx, sorted_indices):
        z = mx.gather_mm(x, self.lora_a.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=sorted_indices)
        return mx.gather_mm(z, self.lora_b.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=sorted_indices)

    def delta(self) -> mx.array:
        """B_e @ A_e per expert: [E, out, in]."""
        return self.lora_b @ self.lora_a


def stack_weight(linear) -> mx.array:
    """[E, out, in] of a SwitchLinear, dequantized when quantized."""
    if "scales" in linear:
        return mx.dequantize(linear.weight, linear.scales, linear.get("biases"), group_size=linear.group_size,
                             bits=linear.bits, mode=linear.mode)
    return linear.weight


class LoRASwitchGLU(nn.Module):
    """A SwitchGLU with PEFT's target_parameters LoRA on its fused gate_up and its down stacks."""

    def __init__(self, glu, r: int, scale: float, split: str, gate_up: bool = True, down: bool = True):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = glu.gate_proj, glu.up_proj, glu.down_proj
        self.activation = glu.activation
        for stack in (self.gate_proj, self.up_proj, self.down_proj):
            stack.freeze()
        experts, inter, hidden = self.gate_proj.num_experts, self.gate_proj.output_dims, self.gate_proj.input_dims
        self.scale, self.split, self.enabled = scale, split, True
        if gate_up:
            self.gate_up = ExpertPair(experts, hidden, 2 * inter, r)
        if down:
            self.down = ExpertPair(experts, inter, hidden, r)

    def split_rows(self, fused: mx.array) -> tuple[mx.array, mx.array]:
        """(gate, up) out of the fused last axis, in transformers' order for this family."""
        if self.split == "interleaved":
            return fused[..., ::2], fused[..., 1::2]
        half = fused.shape[-1] // 2
        return fused[..., :half], fused[..., half:]

    def __call__(self, x, indices):
        from mlx_lm.models.switch_layers import _gather_sort, _scatter_unsort

        # SwitchGLU's own steps (sorting many tokens by expert), with the two deltas added.
        x = mx.expand_dims(x, (-2, -3))
        indices = mx.stop_gradient(indices)
        do_sort = indices.size >= 64
        idx, inv_order = indices, None
        if do_sort:
            x, idx, inv_order = _gather_sort(x, indices)
        up = self.up_proj(x, idx, sorted_indices=do_sort)
        gate = self.gate_proj(x, idx, sorted_indices=do_sort)
        if self.enabled and "gate_up" in self:
            d_gate, d_up = self.split_rows(self.scale * self.gate_up(x, idx, do_sort))
            gate, up = gate + d_gate.astype(gate.dtype), up + d_up.astype(up.dtype)
        h = self.activation(up, gate)
        y = self.down_proj(h, idx, sorted_indices=do_sort)
        if self.enabled and "down" in self:
            y = y + (self.scale * self.down(h, idx, do_sort)).astype(y.dtype)
        if do_sort:
            y = _scatter_unsort(y, inv_order, indices.shape)
        return y.squeeze(-2)

    def fused(self):
        """A plain SwitchGLU computing what this computes (quantized stacks come back dequantized)."""
        from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear

        glu = SwitchGLU(self.gate_proj.input_dims, self.gate_proj.output_dims, self.gate_proj.num_experts,
                        activation=self.activation, bias="bias" in self.gate_proj)
        deltas = {}
        if "gate_up" in self:
            d_gate, d_up = self.split_rows(self.gate_up.delta().swapaxes(-1, -2))   # split along out
            deltas["gate_proj"], deltas["up_proj"] = d_gate.swapaxes(-1, -2), d_up.swapaxes(-1, -2)
        if "down" in self:
            deltas["down_proj"] = self.down.delta()
        for name in ("gate_proj", "up_proj", "down_proj"):
            base = self[name]
            weight = stack_weight(base)
            if name in deltas:
                weight = (weight.astype(mx.float32) + self.scale * deltas[name]).astype(weight.dtype)
            stack = SwitchLinear(base.input_dims, base.output_dims, base.num_experts, bias="bias" in base)
            stack.weight = weight
            if "bias" in base:
                stack.bias = base.bias
            setattr(glu, name, stack)
        return glu


def expert_adapters(model: nn.Module) -> dict[str, LoRASwitchGLU]:
    return {p: m for p, m in model.named_modules() if isinstance(m, LoRASwitchGLU)}


def wrap_experts(model: nn.Module, paths: list[str], r: int, scale: float, split: str,
                 targets: list[str]) -> None:
    """Replace each SwitchGLU at `paths` by a LoRASwitchGLU adapting the `targets` (TARGETS names)."""
    modules = dict(model.named_modules())
    wrapped = [(p, LoRASwitchGLU(modules[p], r, scale, split, gate_up=TARGETS[0] in targets,
                                 down=TARGETS[1] in targets)) for p in paths]
    model.update_modules(tree_unflatten(wrapped))
    for _, mod in wrapped:
        for pair in ("gate_up", "down"):
            if pair in mod:
                mod[pair].unfreeze()
