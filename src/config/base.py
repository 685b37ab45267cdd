"""What every config section shares: strictness, and the hook through which the check step adds the checks
the schema cannot make itself.

A few fields need knowledge that lives above `config` (the built-in chat templates in `data/`, the reward
spec syntax in `rewards/`). `config` imports nothing above it, so those checks are functions of the check
step (`mudpuppy.configure`), handed to validation as pydantic's context. They run inside validation, at
the field they check, so their problems come in the same list, order and path as the schema's own.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo


class _Strict(BaseModel):
    """Base for every section: unknown keys are errors, assignments re-validate, and no float key takes
    nan or inf (YAML's `.nan`, `.inf`): a learning rate of inf trains to an all-NaN adapter that still
    reports "finished", so every float field, in lists and mappings too, refuses them here once."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def outside_check(info: ValidationInfo, name: str, value: Any) -> None:
    """Run the check step's check `name` on `value` (it raises ValueError naming the problem).

    Validation without the check step's context (a section built directly) skips it."""
    check = (info.context or {}).get(name)
    if check is not None:
        check(value)
