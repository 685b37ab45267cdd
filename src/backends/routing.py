"""Whether a run adds a mixture-of-experts router's load-balancing loss, and with what weight.

transformers' mixture-of-experts models (Qwen3-MoE, Mixtral, gpt-oss, ...) add
``router_aux_loss_coef * load_balancing_loss_func(router_logits, ...)`` to their
loss when their config sets ``output_router_logits``. Both runtimes decide from
the model's config.json, before any weight loads, so torch and MLX train on the
same objective: the model's own by default, `model.router_aux_loss_coef` to
choose (TRL's `router_aux_loss_coef`: a weight turns the term on, 0 turns it off).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import MudpuppyError


def router_aux_coefficient(config: dict, override: float | None, where: str) -> float:
    """The weight of the load-balancing loss in every training objective; 0 = not added.

    `config` is the model's config.json (a vision-language model's text_config is read);
    `override` is `model.router_aux_loss_coef` (None: the model's own choice)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    declared = "router_aux_loss_coef" in text and "output_router_logits" in text
    if override is None:
        return float(text["router_aux_loss_coef"] or 0.0) if declared and text["output_router_logits"] else 0.0
    if not declared:
        raise MudpuppyError(
            f"model.router_aux_loss_coef: {where} ({text.get('model_type', 'unknown family')}) has no router "
            "load-balancing loss (its config.json declares no router_aux_loss_coef and output_router_logits); "
            "remove the key")
    return float(override)


def read_router_aux_coefficient(directory: str | Path, override: float | None) -> float:
    """router_aux_coefficient of a model directory's config.json (0 where it has none)."""
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return router_aux_coefficient(config, override, str(directory))


def with_router_aux(ops, total, aux, count: float) -> tuple:
    """The objective's sum with a mixture-of-experts router's weighted load-balancing loss added once
    per unit the trainer averages over (`count`), so the step's loss is the mean objective plus the
    term, as TRL adds it; and the term as the metric ``router_aux_loss`` where the run adds one."""
    value = ops.to_float(aux)
    if value == 0.0:
        return total, {}
    return total + aux * float(count), {"router_aux_loss": value}
