"""The reward both sides of benchmarks/grpo_cpu.py train on: deterministic, cheap, no model.

mudpuppy imports it as `benchmarks/grpo_reward.py:sum_reward` (a user reward function in a file);
TRL's GRPOTrainer gets the function object. Both call it the same way (TRL's keyword convention):
prompts, completions (assistant messages, as the prompts are chat), completion_ids, and every
other column of the data, here `answer`.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+")


def sum_reward(prompts, completions, completion_ids, answer, **_):
    """1.0 when the completion's last number is the answer, plus 0.5 when the completion is that number alone."""
    out = []
    for completion, ref in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        numbers = NUMBER.findall(text)
        right = bool(numbers) and numbers[-1] == str(ref).strip()
        out.append(float(right) + (0.5 if right and text.strip() == str(ref).strip() else 0.0))
    return out
