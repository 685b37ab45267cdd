"""Call every reward function on one batch of completions and check what each returns.

`score` returns a float64 array [n_completions, n_functions] with NaN where a function said None
("not applicable": TRL drops such entries from the weighted sum with nansum). The weights are
applied later, with the advantages; this keeps each function's raw values for its metrics.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import MudpuppyError
from .errors import RewardFunctionError, first_line, raised_at

# TRL passes every dataset column but these by name; the names of the three main arguments would collide.
RESERVED = ("prompt", "completion", "completion_ids", "prompts", "completions")


def score(funcs: Sequence, prompts: list, completions: list, completion_ids: list,
          columns: dict[str, list]) -> np.ndarray:
    """Rewards [n_completions, n_funcs]: each function called the TRL way, its output checked."""
    n = len(completions)
    for what, values in [("prompts", prompts), ("completion_ids", completion_ids), *columns.items()]:
        if values is not None and len(values) != n:   # the caller's bug, not the user's
            raise ValueError(f"score: {what} has {len(values)} entries for {n} completions")
    extra = {k: v for k, v in columns.items() if k not in RESERVED}
    out = np.full((n, len(funcs)), np.nan, dtype=np.float64)
    for j, fn in enumerate(funcs):
        name = getattr(fn, "name", None) or getattr(fn, "__name__", repr(fn))
        try:
            values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **extra)
        except MudpuppyError:
            raise
        except Exception as exc:
            site = raised_at(exc)
            at = f" at {site}" if site else ""
            raise RewardFunctionError(f"reward function {name} raised{at}: {first_line(exc)}") from exc
        out[:, j] = check_rewards(name, values, n)
    return out


def check_rewards(name: str, values: Any, n: int) -> np.ndarray:
    """`values` as float64 [n], None and NaN as NaN; anything else than one number per completion is an error."""
    if isinstance(values, np.ndarray) and values.ndim == 1:
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        shape = f" of shape {values.shape}" if isinstance(values, np.ndarray) else ""
        raise RewardFunctionError(f"reward function {name} returned a {type(values).__name__}{shape}; it must "
                                  "return a list with one float (or None) per completion")
    if len(values) != n:
        raise RewardFunctionError(f"reward function {name} returned {len(values)} values for {n} completions; "
                                  "it must return one float (or None) per completion")
    return np.array([_reward_value(name, i, v) for i, v in enumerate(values)], dtype=np.float64)


def _reward_value(name: str, index: int, value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, (bool, np.bool_)):
        return float(value)   # a pass/fail check reads naturally as True/False: 1.0/0.0
    if isinstance(value, numbers.Real) and not math.isinf(value):
        return float(value)   # NaN stays NaN: the same as None
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise RewardFunctionError(f"reward function {name} returned {shown} ({type(value).__name__}) at index {index}; "
                              "each value must be a finite number, or None for 'not applicable'")
