"""`RewardSpec`s -> callable `RewardFunction`s, and the check that the data has the columns they read.

    specs = parse_reward_specs(cfg.grpo.reward_funcs, cfg.grpo.reward_weights)
    funcs = load_reward_functions(specs, cfg.source_dir, reward_model=factory)
    check_columns(funcs, set(dataset_columns), "data.datasets")    # before the first generation
    rewards = score(funcs, prompts, completions, completion_ids, columns)   # (rewards/scoring.py)

Reward models need a backend to load, which this package does not have: the caller passes
`reward_model`, a factory that takes the spec and returns a plain callable with the same calling
convention. Loading collects every spec's problem and raises them together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .builtin import BUILTINS
from .errors import RewardFunctionError
from .imports import import_function
from .scoring import score
from .specs import RewardSpec

__all__ = ["RewardFunction", "check_columns", "load_reward_functions", "score"]


class RewardFunction:
    """One reward function, ready to call the TRL way; `.name` labels its metrics, `.spec` says where it came from."""

    def __init__(self, spec: RewardSpec, fn: Callable):
        self.spec, self.name, self.fn = spec, spec.name, fn

    @property
    def weight(self) -> float:
        return self.spec.weight

    @property
    def columns(self) -> tuple[str, ...]:
        """The dataset columns a built-in reads (user functions read what they like: unknown here)."""
        if self.spec.kind != "builtin":
            return ()
        column = self.spec.option("column")
        return (column,) if column else ()

    def __call__(self, prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float | None]:
        return self.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)

    def __repr__(self) -> str:
        return f"RewardFunction({self.name!r}, {self.spec.source}, weight={self.weight})"


def load_reward_functions(specs: list[RewardSpec], source_dir: str | None,
                          reward_model: Callable[[RewardSpec], Callable] | None = None) -> list[RewardFunction]:
    """One RewardFunction per spec, in order. User files resolve against `source_dir` (the config's folder)."""
    funcs, problems, modules = [], [], {}
    for spec in specs:
        try:
            funcs.append(RewardFunction(spec, _build(spec, source_dir, reward_model, modules)))
        except RewardFunctionError as exc:
            problems.append(exc)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise RewardFunctionError("\n".join(str(p) for p in problems)) from problems[0]
    return funcs


def _build(spec: RewardSpec, source_dir: str | None, reward_model: Callable | None, modules: dict) -> Callable:
    if spec.kind == "builtin":
        return BUILTINS[spec.target](**dict(spec.options))
    if spec.kind in ("file", "module"):
        return import_function(spec, source_dir, modules)
    if spec.kind != "reward_model":
        raise ValueError(f"unknown reward spec kind {spec.kind!r}")   # only a hand-made spec gets here
    if reward_model is None:
        raise RewardFunctionError(f"reward function {spec.name}: a reward model ({spec.target}) needs a backend to "
                                  "load it; pass load_reward_functions a reward_model factory (the GRPO pipeline does)")
    fn = reward_model(spec)
    if not callable(fn):
        raise TypeError(f"the reward_model factory returned {type(fn).__name__} for {spec.target}, not a callable")
    return fn


def check_columns(funcs: list, columns: set[str], where: str) -> None:
    """Raise one error if a built-in reads a column the data lacks, naming function, column and the columns present."""
    missing = [(f, c) for f in funcs for c in getattr(f, "columns", ()) if c not in columns]
    if not missing:
        return
    what = "; ".join(f"reward function {f.name} reads column '{column}'" for f, column in missing)
    first = missing[0][0].spec.target
    raise RewardFunctionError(
        f"{where}: {what}, which the data does not have (its columns: {', '.join(sorted(columns)) or 'none'}); "
        f"point it at the column holding the reference, e.g. {{{first}: {{column: solution}}}}, or add the column")
