"""The check step: read a run's config, validate it against the schema (`mudpuppy.config`), and check what
only the layers above the schema know, raising one `ConfigError` that lists every problem with its path.

`config` imports nothing above it, so what needs `data/` or `rewards/` is here:

- inside validation, at the field it concerns (passed as pydantic's context, see `config.base`): whether
  `data.chat_template` names a template that exists, and whether `grpo.reward_funcs`, `grpo.tools` and
  `grpo.environment` are specs the reward loader understands;
- after it, on the validated config: what a vision-language base cannot do, and (when the base's
  config.json is on this machine) what its family cannot do exactly, before any weight loads.
"""

from __future__ import annotations

import os

from pydantic import ValidationError

from .config import ConfigError, GrpoConfig, Issue, RunConfig, _missing_files, _pydantic_issues, read_source
from .data.packing import packing_problem
from .data.templates import BUILTIN_TEMPLATES, is_jinja
from .data.vision import is_vision_model, model_config_json, vision_problems
from .rewards.specs import function_spec, parse_reward_specs


def load_config(
    source: str | os.PathLike | dict,
    overrides: list[str] | tuple[str, ...] = (),
    check_files: bool = True,
) -> RunConfig:
    """Read a YAML file (or a dict), apply ``key.sub=value`` overrides, validate.

    Raises `ConfigError` listing every problem found, each with its path.
    """
    raw, origin, source_dir, issues = read_source(source, overrides)
    if issues:
        raise ConfigError(origin, [str(i) for i in issues])
    if "stages" in raw:
        raise ConfigError(origin, ["stages: this file is a curriculum (several runs); run it with `mudpuppy run` "
                                   "or load it with mudpuppy.load_curriculum (docs/curriculum.md)"])
    raw["source_dir"] = source_dir
    try:
        cfg = RunConfig.model_validate(raw, context=SCHEMA_CHECKS)
    except ValidationError as exc:
        raise ConfigError(origin, [str(i) for i in _pydantic_issues(exc)]) from None
    if check_files:
        issues.extend(_missing_files(cfg))
    vision = cfg.model.vision is True or (check_files and is_vision_model(cfg.model))   # auto: its config.json
    issues.extend(Issue(where, what) for where, what in vision_problems(cfg, vision))
    if check_files:                             # refused by family before any weight loads
        issues.extend(family_issues(cfg))
    if issues:
        raise ConfigError(origin, [str(i) for i in issues])
    return cfg


# --------------------------------------------------------------------------- inside validation


def check_chat_template(template: str | None) -> None:
    if template is None or template == "tokenizer" or template in BUILTIN_TEMPLATES or is_jinja(template):
        return
    names = ", ".join(BUILTIN_TEMPLATES)
    raise ValueError(f"unknown chat template {template!r}; use 'tokenizer', one of {names}, or a Jinja template")


def check_grpo_functions(grpo: GrpoConfig) -> None:
    """`grpo.tools` and `grpo.environment` name a function in a file or a module."""
    bad = [f"tools[{i}]: {t!r} is not 'path/to/file.py:function' or 'package.module:function'"
           for i, t in enumerate(grpo.tools) if function_spec(t) is None]
    if grpo.environment is not None and function_spec(grpo.environment) is None:
        bad.append(f"environment: {grpo.environment!r} is not 'path/to/file.py:factory' or 'package.module:factory'")
    if bad:
        raise ValueError("; ".join(bad))


def check_reward_specs(grpo: GrpoConfig) -> None:
    parse_reward_specs(grpo.reward_funcs, grpo.reward_weights)   # raises ValueError naming the entry


# What `config.base.outside_check` runs, by the name each validator gives.
SCHEMA_CHECKS = {
    "data.chat_template": check_chat_template,
    "grpo.tools": check_grpo_functions,
    "grpo.reward_funcs": check_reward_specs,
}


# --------------------------------------------------------------------------- after validation


def family_issues(cfg: RunConfig) -> list[Issue]:
    """What the base model's family cannot do exactly, read from its config.json (when it is on this machine):
    packing across recurrent or chunked layers (data/packing.py), DoRA or dropout on fused experts."""
    config = model_config_json(cfg.model.base_model, cfg.model.revision)
    if not config:
        return []
    issues = []
    problem = packing_problem(config) if cfg.data.packing else None
    if problem:
        issues.append(Issue("data.packing", problem))
    text = config.get("text_config") or config
    experts = text.get("num_local_experts") or text.get("num_experts") or 0
    targets = cfg.adapter.target_modules
    reaches = targets == "all-linear" or (isinstance(targets, list) and any("experts" in t for t in targets))
    if cfg.adapter.type != "none" and isinstance(experts, int) and experts > 1 and reaches:
        family = text.get("model_type") or config.get("model_type") or "this model"
        what = "adapter.type" if cfg.adapter.type == "dora" else "adapter.dropout" if cfg.adapter.dropout else None
        if what:
            issues.append(Issue(what, f"{family} holds its {experts} experts as fused tensors, which PEFT adapts "
                                      f"without {'DoRA' if what == 'adapter.type' else 'dropout'}; use adapter.type "
                                      "lora (or qlora) with adapter.dropout: 0, or target_modules without the experts"))
    return issues
