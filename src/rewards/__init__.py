"""GRPO reward functions: the built-ins, the `grpo.reward_funcs` parser, and the loader for user functions.

A reward function is called the TRL 1.x way, with keyword arguments: `prompts` (each as the dataset
had it: a string or a list of messages), `completions` (strings, or `[{"role": "assistant",
"content": text}]` for chat prompts), `completion_ids` (lists of token ids) and every other dataset
column by name (`answer=[...]`), and returns one float, or None for "not applicable", per completion.

    options    the built-ins' options, defaults and checks (pure Python)
    specs      reward_funcs / reward_weights -> RewardSpec list; config validation runs it (pure Python)
    text       completion text, normalisation, numbers and <answer> tags for the built-ins
    builtin    exact_match, contains, regex, format, length: BUILTINS[name](**options)
    imports    a user's function from a file or module, with one clear message per failure
    loading    RewardFunction, load_reward_functions, check_columns
    scoring    score: call every function on a batch, check the results -> float64 [completions, functions]
    errors     RewardFunctionError
"""

from .builtin import BUILTINS
from .errors import RewardFunctionError
from .loading import RewardFunction, check_columns, load_reward_functions
from .scoring import score
from .specs import RewardSpec, parse_reward_specs

__all__ = [
    "BUILTINS",
    "RewardFunction",
    "RewardFunctionError",
    "RewardSpec",
    "check_columns",
    "load_reward_functions",
    "parse_reward_specs",
    "score",
]
