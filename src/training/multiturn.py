"""Multi-turn rollouts: sample, run the tools the model called, append their results, sample again.

TRL 1.16's `_tool_call_loop`, over token ids (nothing sampled is ever encoded
again: the ids trained are the ids sampled):

1. every prompt is sampled once, up to max_completion_length tokens;
2. a turn that calls tools (tools.parse_turn) has them run (tools.run_call), and
   the results are appended as the chat format writes them (tools.suffix_ids:
   the tool messages and the next assistant header); those tokens are context,
   never trained and never scored as the model's (mask False);
3. the rollouts that called tools are sampled again, each with what is left of
   its budget: max_completion_length counts every token after the prompt,
   tool results included; results that would not fit (or would pass the
   model's context) are not appended and the rollout ends there;
4. up to max_tool_calling_iterations rounds (None: until no turn calls a tool).

What reward functions receive as a completion is the exchange as messages:
assistant turns (with their `tool_calls`), and `{"role": "tool", "name", "content"}`
for each result, in order.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from ..data.tools import BUILTIN_TOOL_FORMATS
from .tools import Tool, parse_turn, result_messages, run_call, suffix_ids, template_syntax


@dataclass
class Exchange:
    """One rollout: every token after the prompt, which of them were sampled, and the messages."""

    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    calls: int = 0
    failures: int = 0

    def add(self, ids: list[int], sampled: bool) -> None:
        self.ids += ids
        self.sampled += [sampled] * len(ids)

    @property
    def sampled_count(self) -> int:
        return sum(self.sampled)


class ToolLoop:
    """Runs rollouts for one run: the tokenizer, the tool format, the budget and the limits."""

    def __init__(self, tokenizer, fmt: str, max_completion_length: int, max_context: int | None,
                 max_iterations: int | None, timeout: float, stop_ids: set[int]):
        """`fmt`: how the prompts offered the tools (the data's tool format: template, hermes, llama3)."""
        self.tokenizer, self.fmt, self.stop_ids = tokenizer, fmt, set(stop_ids)
        self.syntax = fmt if fmt in BUILTIN_TOOL_FORMATS else template_syntax(tokenizer)
        self.budget, self.max_context, self.timeout = max_completion_length, max_context, timeout
        self.max_iterations = sys.maxsize if max_iterations is None else max_iterations

    def run(self, prompts: list[list[int]], tools: list[list[Tool]],
            sample: Callable[[list[list[int]], int, int], list[list[int]]]) -> list[Exchange]:
        """`tools[i]`: what rollout i may call; `sample(prompts, max_new_tokens, round)` samples one turn each."""
        out = [Exchange() for _ in prompts]
        turns = [self.read(ex, ids) for ex, ids in zip(out, sample(prompts, self.budget, 0))]
        active = [i for i, t in enumerate(turns) if t.calls]
        rounds = 0
        while active and rounds < self.max_iterations:
            rounds += 1
            going = []
            for i in active:
                if self.answer(out[i], turns[i], {t.name: t.fn for t in tools[i]}, prompts[i]):
                    going.append(i)
            if not going:
                break
            left = {i: self.budget - len(out[i].ids) for i in going}
            new = sample([prompts[i] + out[i].ids for i in going], max(left.values()), rounds)
            for i, ids in zip(going, new):
                turns[i] = self.read(out[i], ids[: left[i]])
            active = [i for i in going if turns[i].calls]
        return out

    def read(self, ex: Exchange, ids: list[int]):
        """Append one sampled turn; the turn as read back (its calls)."""
        ex.add(list(ids), True)
        turn = parse_turn(self.tokenizer.decode(ids, skip_special_tokens=True), self.syntax)
        ex.messages.append(turn.message())
        return turn

    def answer(self, ex: Exchange, turn, tools: dict, prompt: list[int]) -> bool:
        """Run the turn's calls and append their results; False when they do not fit (the rollout ends)."""
        results = []
        for call in turn.calls:
            content, failed = run_call(call, tools, self.timeout)
            ex.calls += 1
            ex.failures += failed
            results.append((call.name, content))
        call_message, tool_messages = result_messages(self.fmt, turn, results)
        suffix = suffix_ids(self.tokenizer, call_message, tool_messages, self.stop_ids)
        total = len(ex.ids) + len(suffix)
        if total >= self.budget or (self.max_context and len(prompt) + total >= self.max_context):
            return False
        ex.add(suffix, False)
        ex.messages += [{"role": "tool", "name": name, "content": content} for name, content in results]
        return True


class Agent:
    """What a GRPO run's rollouts need beyond sampling: the loop, the tools, the environments."""

    def __init__(self, loop: ToolLoop, tools: list[Tool], environments=None, reprompt=None):
        """`reprompt(example, observation)`: the prompt ids of `example` with an environment's
        observation appended to its last user message."""
        self.loop, self.tools, self.environments, self.reprompt = loop, tools, environments, reprompt

    def run(self, examples: list, prompt_ids: list[list[int]], sample) -> tuple[list[Exchange], list | None, list]:
        """Rollouts of `examples` (PromptExamples, one per completion, their prompts as `prompt_ids`):
        the exchanges, the environment instance of each (None without environments), and the prompts
        as sampled from (an environment's observation changes them)."""
        tools = [list(self.tools) for _ in examples]
        instances = None
        if self.environments is not None:
            instances = self.environments.take(len(examples))
            prompt_ids = list(prompt_ids)
            for i, (ex, env) in enumerate(zip(examples, instances)):
                observation = self.environments.reset(env, ex.fields)
                if observation:
                    prompt_ids[i] = self.reprompt(ex, observation)
                tools[i] += self.environments.tools_of(env)
        return self.loop.run(prompt_ids, tools, sample), instances, prompt_ids
