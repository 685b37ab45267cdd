"""Which of a model's layers an adapter targets, from the config's `adapter.target_modules`: shared by every
backend so that `all-linear` and the error for a name that matches nothing read the same on torch and MLX."""

from __future__ import annotations

from ...errors import MudpuppyError


def choose_target_modules(linear: set[str], wanted, parameters: set[str] | frozenset = frozenset()) -> list[str]:
    """The adapter's target leaf names, from the model's linear leaf names and the config's wish.

    Shared by every backend so that `all-linear` and the error for a name that
    matches nothing read the same on torch and MLX. `parameters` are the fused
    expert tensors a mixture-of-experts model holds instead of per-expert linears
    (``experts.gate_up_proj``): names the config may list too, targeted through
    `choose_target_parameters` rather than as modules.
    """
    if wanted == "all-linear":
        if not linear and not parameters:
            raise MudpuppyError("adapter.target_modules: this model has no linear layers to adapt")
        return sorted(linear)
    missing = [w for w in wanted if w not in linear and w not in parameters]
    if missing:
        known = ", ".join(sorted(linear) + sorted(parameters))
        raise MudpuppyError(
            f"adapter.target_modules: {', '.join(missing)} match no linear layer in this model; "
            f"its linear layers are: {known}")
    return [w for w in wanted if w in linear]


def choose_target_parameters(parameters: set[str], wanted) -> list[str]:
    """The fused expert tensors to adapt (PEFT's ``target_parameters``, e.g. ``experts.down_proj``): every
    one under `all-linear`, since they hold most of a mixture-of-experts model's weights; else those named."""
    if wanted == "all-linear":
        return sorted(parameters)
    return [w for w in wanted if w in parameters]
