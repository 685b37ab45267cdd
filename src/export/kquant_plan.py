"""A K-quant GGUF's tensor plan: the f16 plan (export/gguf.py) retyped by llama-quantize's rules
(kquant_recipes.py), each quantized tensor given its row of the importance matrix (imatrix.py)."""

from __future__ import annotations

import numpy as np

from ..errors import MudpuppyError
from .gguf_families import Family, n_experts
from .kquant_recipes import ModelInfo, sort_key, tensor_types


def model_info(config: dict, family: Family) -> ModelInfo:
    import gguf

    n_head = int(config["num_attention_heads"])
    return ModelInfo(gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, family.arch)], int(config["num_hidden_layers"]),
                     n_head, int(config.get("num_key_value_heads") or n_head), n_experts(config))


def plan_k_quant(config: dict, family: Family, plan: list, quant: str,
                 imatrix: dict[str, np.ndarray] | None, where: str) -> list:
    """`plan` (gguf.Planned rows: name, shape, qtype, exact, weights) as the f16 plan retyped as llama-quantize would (kquant_recipes), each quantized tensor given its
    importance row, in llama-quantize's tensor order (by layer, then name)."""
    import gguf

    chosen = tensor_types({p.name: p.shape for p in plan}, quant, model_info(config, family))
    for p in plan:
        if chosen[p.name] is None:
            continue
        p.qtype, p.exact = getattr(gguf.GGMLQuantizationType, chosen[p.name]), True
        weights = (imatrix or {}).get(p.name)
        expected = p.shape[-1] * (p.shape[0] if len(p.shape) == 3 else 1)        # ne[0] * ne[2]
        if weights is not None and weights.size != expected:
            if p.name == "token_embd.weight":                                    # llama-quant.cpp:1283-1292
                continue
            raise MudpuppyError(f"{where}: the importance matrix holds {weights.size} values for {p.name}, "
                                f"which has {expected} columns; was it collected from another model?")
        p.weights = None if weights is None else np.asarray(weights, dtype=np.float32).reshape(-1)
    return sorted(plan, key=lambda p: sort_key(p.name))
