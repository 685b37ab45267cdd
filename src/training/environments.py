"""GRPO environments: one object per rollout that holds state across its turns (TRL's environment_factory).

`grpo.environment: path/to/env.py:make_env` names a factory (a function or a
class) called with no arguments. What TRL 1.16's GRPOTrainer does with it, done
the same way here:

- each instance must define `reset(**row)`: it is called before the rollout
  with every column of the prompt's row; a string it returns (an observation)
  is appended to the prompt's last user message, None leaves the prompt as is;
- its public methods other than `reset` and `get_reward` are the rollout's
  tools (schemas from type hints and docstrings, as for `grpo.tools`), bound to
  that rollout's instance, so a call changes only its own rollout's state;
- a `get_reward()` method, if defined, is one more reward function, named
  after the class, weight 1, called on each rollout's instance after its last
  turn;
- every reward function is also passed `environments=[...]`, one instance per
  completion, so it can read the state a rollout left behind;
- instances are made once and reused (reset) from one generation to the next:
  the pool grows to the number of rollouts in a generation batch.

The factory is called once when the run starts (before the model loads), so a
factory that raises, an instance without `reset`, or a tool method without a
schema stops the run with one message naming the file and the function.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from ..errors import MudpuppyError
from ..rewards.errors import first_line, raised_at
from ..rewards.imports import import_function
from ..rewards.specs import RewardSpec, function_spec
from .tools import Tool, ToolError, schema_of

RESERVED_METHODS = ("reset", "get_reward")


class Environments:
    """The factory, the pool of instances, and the tool schemas every instance exposes."""

    def __init__(self, entry: str, source_dir: str | None):
        spec = function_spec(entry)
        if spec is None:
            raise ToolError(f"grpo.environment ({entry}): write it as 'path/to/file.py:factory' or "
                            "'package.module:factory'")
        self.source = entry
        self.factory = import_function(spec, source_dir, role="grpo.environment")
        probe = self.make()
        self.cls = type(probe)
        self.method_names = [name for name, _ in inspect.getmembers(self.cls, predicate=inspect.isfunction)
                             if name not in RESERVED_METHODS and not name.startswith("_")]
        where = f"grpo.environment ({entry})"
        self.schemas = [schema_of(getattr(probe, name), f"{where}, method {name}") for name in self.method_names]
        self.has_reward = callable(getattr(probe, "get_reward", None))
        self.pool = [probe]

    def make(self):
        try:
            instance = self.factory()
        except MudpuppyError:
            raise
        except Exception as exc:
            site = raised_at(exc)
            raise ToolError(f"grpo.environment ({self.source}): the factory raised"
                            f"{f' at {site}' if site else ''}: {first_line(exc)}") from exc
        if not callable(getattr(instance, "reset", None)):
            raise ToolError(f"grpo.environment ({self.source}): the factory returned a {type(instance).__name__} "
                            "without a reset(**row) method; each environment must define one (it starts a rollout)")
        return instance

    def tools_of(self, instance) -> list[Tool]:
        return [Tool(name, getattr(instance, name), schema, f"{self.source}.{name}")
                for name, schema in zip(self.method_names, self.schemas)]

    def take(self, n: int) -> list:
        """n instances for one generation batch, made only when the pool is short."""
        while len(self.pool) < n:
            self.pool.append(self.make())
        return self.pool[:n]

    def reset(self, instance, fields: dict) -> str | None:
        """Start a rollout: the observation to append to the prompt, or None."""
        try:
            observation = instance.reset(**fields)
        except Exception as exc:
            site = raised_at(exc)
            raise ToolError(f"grpo.environment ({self.source}): reset raised{f' at {site}' if site else ''}: "
                            f"{first_line(exc)}") from exc
        if observation is not None and not isinstance(observation, str):
            raise ToolError(f"grpo.environment ({self.source}): reset returned a {type(observation).__name__}; it "
                            "must return a string (appended to the prompt's last user message) or None")
        return observation

    def reward_function(self) -> Callable:
        """get_reward as a reward function (the calling convention of rewards/scoring.py)."""
        cls = self.cls

        def get_reward(environments=None, **_):
            return [e.get_reward() if type(e) is cls else None for e in environments]

        get_reward.__name__ = cls.__name__
        return get_reward

    def reward_spec(self) -> RewardSpec:
        return RewardSpec("environment", self.cls.__name__, self.source)
