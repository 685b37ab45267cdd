"""A reward model (a `method: rm` run's output) as a GRPO reward function.

The model scores prompt + completion as it was trained to: through its own
tokenizer and chat template (the rm run's `data.chat_template` when its
config.yaml is beside the weights), cut to its run's `data.sequence_len`.
It loads on first use, so a broken user reward file is reported before any
model is read, and it stays loaded for the rest of the run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from ..config import ModelConfig, bounded_yaml_load, resolve_relative
from ..data import Example
from ..data.render import as_messages, render_chat
from ..data.templates import apply_chat_template_choice
from ..errors import MudpuppyError
from ..evaluation.score import sequence_scores

DEFAULT_MAX_LEN = 2048


class RewardModelFunction:
    """Called like any reward function; returns the model's score per completion."""

    def __init__(self, backend, path: Path, batch_size: int):
        self.backend, self.path, self.batch_size = backend, path, batch_size
        self.handle, self.template, self.max_len = None, None, DEFAULT_MAX_LEN
        self.__name__ = "reward_model"

    def load(self) -> None:
        if not (self.path / "config.json").is_file():
            raise MudpuppyError(f"reward model {self.path}: no config.json there; point reward_model at the "
                                "output_dir of a finished method: rm run")
        chat_template = None
        run_config = self.path / "config.yaml"
        if run_config.is_file():
            try:        # the config of a folder the user points at: bounded like every YAML mudpuppy reads
                raw = bounded_yaml_load(run_config.read_text(encoding="utf-8")) or {}
            except (yaml.YAMLError, RecursionError, UnicodeDecodeError) as exc:
                raise MudpuppyError(f"reward model {self.path}: its config.yaml cannot be read "
                                    f"({type(exc).__name__}); fix or remove it") from None
            data = raw.get("data", {}) if isinstance(raw, dict) else {}
            data = data if isinstance(data, dict) else {}
            chat_template, self.max_len = data.get("chat_template"), data.get("sequence_len", DEFAULT_MAX_LEN)
        self.handle = self.backend.load_model(ModelConfig(base_model=str(self.path)), "fp32",
                                              head="sequence_classification")
        self.template = apply_chat_template_choice(self.handle.tokenizer, chat_template)

    def __call__(self, prompts, completions, completion_ids, **columns) -> list[float]:
        if self.handle is None:
            self.load()
        tok = self.handle.tokenizer
        sequences = []
        for prompt, completion in zip(prompts, completions):
            text = self.render(prompt, completion)
            ids = tok(text, add_special_tokens=self.template is None)["input_ids"][-self.max_len:]
            sequences.append(Example(np.asarray(ids, dtype=np.int32), np.zeros(len(ids), dtype=bool)))
        scores = []
        for start in range(0, len(sequences), self.batch_size):
            scores += sequence_scores(self.backend, self.handle, sequences[start : start + self.batch_size]).tolist()
        return [float(s) for s in scores]

    def render(self, prompt, completion) -> str:
        answer = completion[-1]["content"] if isinstance(completion, list) else completion
        if self.template is None:
            return (prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)) + answer
        return render_chat(self.handle.tokenizer, as_messages(prompt, "user") + as_messages(answer, "assistant"))


def reward_model_function(backend, spec, source_dir: str | None) -> RewardModelFunction:
    options = dict(spec.options)
    return RewardModelFunction(backend, resolve_relative(spec.target, source_dir), int(options.get("batch_size", 16)))
