"""Setting up a GRPO run's tools and environments: loaded before the model, offered in the prompts.

    tools, environments = load_agent(cfg)                 # before the model loads: import errors first
    funcs += environment_reward(environments, funcs)      # get_reward() as one more reward function
    offer_tools(loaded, schemas(tools, environments))     # every prompt renders the tool schemas
    ... prepare_data ...
    agent = build_agent(cfg, tokenizer, loaded, report, tools, environments, stop_ids, context)

The schemas are added to each record's `tools` column before tokenization (after the record's own,
if it has some), so the prompts offer them exactly as the data pipeline renders tools for SFT:
through the chat template where it renders them, else in a built-in format (data/tools.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from ..data.prepare import render_options
from ..data.render import render_prompt_only
from ..rewards import RewardFunction
from ..rewards.specs import unique_names
from .environments import Environments
from .multiturn import Agent, ToolLoop
from .tools import ToolError, load_tools


def load_agent(cfg):
    """(tools, environments or None) of the config's grpo section; one message for every problem."""
    g = cfg.rollout
    tools = load_tools(g.tools, cfg.source_dir)
    environments = Environments(g.environment, cfg.source_dir) if g.environment else None
    if environments is not None:
        clash = {t.name for t in tools} & set(environments.method_names)
        if clash:
            raise ToolError(f"grpo.environment ({g.environment}) has methods named like tools in grpo.tools "
                            f"({', '.join(sorted(clash))}); the model calls tools by name, so each must be unique")
        if not g.reward_funcs and not environments.has_reward:
            raise ToolError(f"grpo.reward_funcs is empty and the environment ({g.environment}) defines no "
                            "get_reward(); name a reward function or give the environment a get_reward method")
    return tools, environments


def environment_reward(environments, funcs: list) -> list[RewardFunction]:
    """The environment's get_reward as a reward function (weight 1, named after its class), or nothing."""
    if environments is None or not environments.has_reward:
        return []
    spec = environments.reward_spec()
    name = unique_names([f.name for f in funcs] + [spec.name])[-1]     # a repeat gets _2, as reward names do
    return [RewardFunction(replace(spec, name=name), environments.reward_function())]


def schemas(tools: list, environments) -> list[dict]:
    return [t.schema for t in tools] + (list(environments.schemas) if environments is not None else [])


def offer_tools(loaded, offered: list[dict]) -> None:
    """Add the schemas to every record's tools (train and held-out), and to each dataset's fingerprint,
    so a data cache written without them is not reused."""
    if not offered:
        return
    names = {s["function"]["name"] for s in offered}
    digest = hashlib.sha256(json.dumps(offered, sort_keys=True, default=str).encode()).hexdigest()[:12]
    for ds in loaded.train + loaded.val:
        for rec in ds.records:
            own = [t for t in (rec.data.get("tools") or []) if t["function"]["name"] not in names]
            rec.data["tools"] = own + offered
        ds.fingerprint = f"{ds.fingerprint}+tools:{digest}"


def tool_format(report) -> str:
    """The one tool format the prompts were rendered in (data.report.tool_formats)."""
    found = set(report.tool_formats.values())
    if len(found) > 1:
        raise ToolError(f"grpo.tools: the datasets render tools in different formats ({', '.join(sorted(found))}); "
                        "set the same tool_format on every dataset")
    return found.pop() if found else "template"


def build_agent(cfg, tokenizer, loaded, report, tools: list, environments, stop_ids, context: int | None):
    """The run's Agent, or None when it has neither tools nor an environment."""
    if not tools and environments is None:
        return None
    g = cfg.rollout
    fmt = tool_format(report)
    loop = ToolLoop(tokenizer, fmt, g.max_completion_length, context, g.max_tool_calling_iterations,
                    g.tool_timeout, stop_ids)
    return Agent(loop, tools, environments, prompt_renderer(cfg, tokenizer, loaded, fmt))


def prompt_renderer(cfg, tokenizer, loaded, fmt: str):
    """reprompt(example, observation): the example's prompt with an environment's observation appended to
    its last user message (TRL appends it to the content), rendered as its dataset renders prompts."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    datasets = sorted(loaded.train + loaded.val, key=lambda ds: len(ds.name), reverse=True)
    cap = cfg.data.sequence_len

    def reprompt(example, observation: str) -> list[int]:
        ds = next((d for d in datasets if example.source.startswith(d.name)), datasets[0])
        opts = replace(render_options(ds.spec, has_template), tool_format=fmt)
        prompt = example.fields["prompt"]
        if isinstance(prompt, str):
            prompt = prompt + observation
        else:
            last = prompt[-1]
            prompt = prompt[:-1] + [{**last, "content": (last.get("content") or "") + observation}]
        rendered = render_prompt_only(tokenizer, prompt, opts, example.fields.get("tools"))
        ids = tokenizer(rendered.text, add_special_tokens=rendered.add_special_tokens)["input_ids"]
        return list(ids)[-cap:]   # as PromptExample.truncated: the end holds the question

    return reprompt
