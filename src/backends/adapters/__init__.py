"""Move LoRA and DoRA adapters between PEFT's layout and mlx-lm's, losslessly.

The two libraries store the same numbers differently:

=====================  ========================================  ==============================
                       PEFT (adapter_model.safetensors)          mlx-lm (adapters.safetensors)
=====================  ========================================  ==============================
down-projection        ``base_model.model.<path>.lora_A.weight`` ``<path>.lora_a``  [in, r]
                       [r, in]
up-projection          ``<...>.lora_B.weight``  [out, r]         ``<path>.lora_b``  [r, out]
DoRA magnitude         ``<...>.lora_magnitude_vector`` [out]     ``<path>.m``  [out]
scaling                ``lora_alpha`` / r (rsLoRA: / sqrt(r))    ``scale``, an absolute factor
which modules          ``target_modules`` (leaf names)           ``keys`` (paths inside a block),
                                                                 ``num_layers`` (last N blocks)
=====================  ========================================  ==============================

Both compute base(x) + scale * (x @ A^T) @ B^T, so a conversion is a rename,
a transpose and a scale; tensors are copied bit for bit in their stored dtype
(bf16 included, which numpy cannot represent, so safetensors files are read
and written here as raw bytes). An mlx-lm copy written by mudpuppy carries the
PEFT config it came from, so PEFT -> mlx-lm -> PEFT gives back identical files.

Mixture-of-experts experts held as fused 3-D tensors (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``) take PEFT's ``target_parameters`` LoRA (``lora.ParamWrapper``): one
rank-r pair per expert, stored as ``<experts>[.base_layer].lora_A.weight`` [E*r, in] (expert e's
rows at e*r...) and ``lora_B.weight`` [out, r*E] (expert e's k-th column at k*E + e); a module
with both tensors targeted nests two wrappers, gate_up_proj the inner (``.base_layer``) one, as
PEFT wraps the parameters in the order the module defines them. mlx-lm's layout has no fused
gate/up: the mlx copy holds mlx-lm's LoRASwitchLinear pairs on ``gate_proj``, ``up_proj`` (the same
A twice, B's two parts) and ``down_proj``, which `mlx_lm.load` reads and which convert back exactly
(their two A's must be equal). Where the SwitchGLU sits and how gate_up's rows hold gate and up
is the model's, recorded by the MLX backend (`Adapter.expert_layout`).

Pure numpy and json: the torch backend, the MLX backend and the CLI all use
this module, and none of them should have to import the other's runtime.
"""

from .base_record import local_base_record, read_base_record, record_base, rename_in_card
from .convert import convert_adapter, detect_format, read_adapter
from .experts import (
    EXPERT_PARAMS, MLX_STACKS, expert_keys, expert_param, expert_targets, experts_from_mlx, join_rows,
    mlx_expert_tensors, peft_expert_key, split_rows,
)
from .mlx_format import adapter_from_mlx, mlx_config_for, write_mlx
from .neutral import (
    BASE_FILE, CONFIG_FILE, HEAD_MODULES, HEAD_TASKS, MLX_SUBDIR, MLX_WEIGHTS, MUDPUPPY_KEY, PEFT_PREFIX,
    PEFT_WEIGHTS, Adapter, ExpertAdapter, ModuleAdapter, is_head_weight,
)
from .peft_format import PEFT_UNCONVERTIBLE, adapter_from_peft, peft_config_for, write_peft
from .targets import choose_target_modules, choose_target_parameters
from .tensors import AdapterError, RawTensor, read_safetensors, write_safetensors

__all__ = [
    "AdapterError", "RawTensor", "read_safetensors", "write_safetensors",
    "Adapter", "ModuleAdapter", "ExpertAdapter", "is_head_weight",
    "CONFIG_FILE", "PEFT_WEIGHTS", "MLX_WEIGHTS", "MLX_SUBDIR", "PEFT_PREFIX", "MUDPUPPY_KEY", "BASE_FILE",
    "HEAD_TASKS", "HEAD_MODULES", "PEFT_UNCONVERTIBLE", "EXPERT_PARAMS", "MLX_STACKS",
    "detect_format", "read_adapter", "convert_adapter",
    "adapter_from_peft", "peft_config_for", "write_peft",
    "adapter_from_mlx", "mlx_config_for", "write_mlx",
    "expert_targets", "expert_param", "experts_from_mlx", "peft_expert_key", "mlx_expert_tensors", "expert_keys",
    "split_rows", "join_rows",
    "local_base_record", "record_base", "rename_in_card", "read_base_record",
    "choose_target_modules", "choose_target_parameters",
]
