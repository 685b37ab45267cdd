"""A model loaded for conversation: messages in, streamed text out.

The target is found and loaded as `mudpuppy eval` finds and loads it (evaluation/targets.py):
a run directory brings its base, adapter, tokenizer and chat template; an adapter
directory, a model directory, a .gguf file or an alias work too. The prompt is rendered
with `data.render.render_chat`, the function training renders conversations with, under
the template the run trained with (`apply_chat_template_choice`), and tokenized as
training tokenizes chat (the template writes its own special tokens; special-token text inside
a message stays text, literal.py).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

from ..backends.protocol import Sampling
from ..data.render import render_chat
from ..data.templates import BUILTIN_TEMPLATES, apply_chat_template_choice
from ..errors import MudpuppyError
from ..evaluation.heldout import stop_token_ids
from .literal import literal_prompt_ids
from .streaming import stream_ids
from .text import TextStream


# Below this temperature an answer is greedy, as vLLM treats it (its _SAMPLING_EPS): logits divided by
# a temperature near 0 overflow float32 (1e-300 is 0 in float32: inf and NaN), and the distribution
# is one-hot long before that anyway.
TEMPERATURE_FLOOR = 1e-5


@dataclass(frozen=True)
class GenerationOptions:
    """How one answer is generated. A temperature below TEMPERATURE_FLOOR (0 included) is greedy
    decoding (the protocol's `generate`)."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None           # None: a fresh random seed for each sampled answer
    stop: tuple[str, ...] = ()        # strings that end the answer (not included in it)

    def sampling(self) -> Sampling | None:
        if self.temperature < TEMPERATURE_FLOOR:
            return None
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


@dataclass
class Completion:
    text: str
    token_ids: list[int]              # generated ids, the stop token left out
    prompt_tokens: int
    finish_reason: str                # "stop" (stop token or string) or "length"
    seconds_to_first_token: float | None = None
    seconds: float = 0.0
    generated: int = 0                # forward passes that produced a token (the stop token counts)

    @property
    def completion_tokens(self) -> int:
        return self.generated

    def decode_rate(self) -> float | None:
        """Tokens per second after the first one (the prompt's prefill is in the first token's time)."""
        if self.seconds_to_first_token is None or self.generated < 2:
            return None
        span = self.seconds - self.seconds_to_first_token
        return (self.generated - 1) / span if span > 0 else None


class Answer:
    """One answer's generated ids as they come (the stop token included), turned into final text and a
    Completion: what the chat REPL's single-sequence path and the server's scheduler both build."""

    def __init__(self, tokenizer, stop_ids, stop: tuple[str, ...] = (),
                 on_text: Callable[[str], None] | None = None):
        self.stream = TextStream(tokenizer, stop)
        self.stop_ids = set(stop_ids)
        self.on_text = on_text
        self.ids: list[int] = []          # the answer's ids, the stop token left out
        self.generated = 0                # ids taken, the stop token included
        self.first: float | None = None   # seconds to the first id
        self.reason = "length"
        self.started = time.perf_counter()

    def add(self, token: int) -> bool:
        """Take one generated id; False once the answer is complete (its stop token or a stop string)."""
        self.generated += 1
        if self.first is None:
            self.first = time.perf_counter() - self.started
        if token in self.stop_ids:
            self.reason = "stop"
            return False
        self.ids.append(token)
        piece = self.stream.add(token)
        if piece and self.on_text is not None:
            self.on_text(piece)
        if self.stream.stopped:
            self.reason = "stop"
            return False
        return True

    def finish(self, prompt_tokens: int) -> Completion:
        """The rest of the text handed out, and the Completion."""
        rest = self.stream.flush()
        if rest and self.on_text is not None:
            self.on_text(rest)
        return Completion(self.stream.text, self.ids, prompt_tokens, self.reason, self.first,
                          time.perf_counter() - self.started, self.generated)


def answer_seed(options: GenerationOptions) -> int:
    """The request's seed, or a fresh one for each sampled answer."""
    return options.seed if options.seed is not None else secrets.randbelow(2**31)


@dataclass
class ChatModel:
    backend: object
    handle: object
    name: str                         # what the server calls it; the target as given
    description: str = ""
    system_prompt: str | None = None  # the run's data.datasets[0].system_prompt, if it set one
    stop_ids: list[int] = field(default_factory=list)

    @property
    def tokenizer(self):
        return self.handle.tokenizer

    def render(self, messages: list[dict]) -> str:
        """The prompt text for the next assistant turn: training's rendering of these messages."""
        return render_chat(self.tokenizer, messages, add_generation_prompt=True)

    def prompt_ids(self, messages: list[dict], max_chars: int | None = None) -> list[int]:
        """The rendered prompt's ids; special-token text inside a message stays text (literal.py).
        literal.PromptTooLong, before tokenizing, when the rendered prompt is longer than `max_chars`."""
        return literal_prompt_ids(self.tokenizer, self.render, messages, max_chars)

    def complete(self, messages: list[dict], options: GenerationOptions,
                 on_text: Callable[[str], None] | None = None, prompt: list[int] | None = None) -> Completion:
        """The assistant's answer to `messages`, each final piece of text passed to `on_text` as it comes.
        `prompt`: their ids, when the caller has them already (bounds.PromptBound)."""
        prompt = self.prompt_ids(messages) if prompt is None else prompt
        answer = Answer(self.tokenizer, self.stop_ids, options.stop, on_text)
        stream_ids(self.backend, self.handle, prompt, options.max_new_tokens, self.stop_ids, options.sampling(),
                   answer_seed(options), answer.add)
        return answer.finish(len(prompt))


def load_chat_model(target: str, backend: str | None = None, precision: str = "auto", base_model: str | None = None,
                    chat_template: str | None = None, name: str | None = None,
                    trust_remote_code: bool = False, base: bool = False) -> ChatModel:
    """TARGET (run, adapter, model directory, .gguf or alias) loaded on `backend` (default: the run's, else auto).
    With `base`, the target's base with no adapter, loaded as `eval --base` loads it (a QLoRA run's base
    quantized as in training, the run's tokenizer and template). Model code runs only with
    `trust_remote_code` (--trust-remote-code), never from a run's config.yaml."""
    from ..backends import create_backend
    from ..evaluation.targets import resolve_target

    column = resolve_target(target, base_model, chat_template, trust_remote_code)
    run_backend = column.cfg.backend if column.kind == "run" else "auto"
    if base:
        column = column.base()
        if column is None:
            raise MudpuppyError(f"{target}: a plain model, with no base to compare it with")
    impl = create_backend(backend or run_backend)
    handle = column.load(impl, precision)
    if apply_chat_template_choice(handle.tokenizer, column.cfg.data.chat_template) is None:
        raise MudpuppyError(f"{target}: its tokenizer has no chat template, so there is no way to lay out a "
                            f"conversation; pass --chat-template with a built-in ({', '.join(BUILTIN_TEMPLATES)}) "
                            "or your own Jinja")
    system = None
    if (column.kind == "run" or base) and column.cfg.data.datasets:
        system = column.cfg.data.datasets[0].system_prompt
    return ChatModel(impl, handle, name or default_name(target), column.describe(), system,
                     stop_token_ids(handle.tokenizer))


def default_name(target: str) -> str:
    from pathlib import Path

    path = Path(target).expanduser()
    return path.resolve().name if path.exists() else target
