"""The page's chat pane: a finished run (and its base model beside it, same prompt) answering through
`mudpuppy chat`'s own session (serving/chat.py's ChatSession: the prompt rendered as training rendered it,
special-token text inside a message kept literal, the prompt bounded by the model's context in characters
then tokens, the answer cut where the context ends) over `mudpuppy serve`'s engine (serving/engine.py:
load_chat_model, the backend's token-by-token `stream`).

Models load lazily, on the first message to a run, in the page's own process, and one run at a time: the
run's model, and its base when the pane asks for it beside; picking another run frees both first (their
references dropped and collected) and the page says so. The page sends the whole conversation with each
message, so nothing of a conversation lives here but the loaded models.
"""

from __future__ import annotations

import gc
import math
import threading
from pathlib import Path

from ..errors import MudpuppyError
from ..serving.bounds import ContextExceeded
from ..serving.chat import ChatSession
from ..serving.engine import GenerationOptions, load_chat_model
from .runs import inside, relative_name

MAX_TOKENS = 4096               # `mudpuppy serve --max-tokens`' default: the most one answer may ask for
ROLES = ("user", "assistant")


class TalkError(MudpuppyError):
    """A chat request the pane should not have sent (no such run, a malformed conversation)."""


def options_of(body: dict) -> GenerationOptions:
    """The answer's options from the pane, within what `mudpuppy chat` / `serve` accept."""
    try:
        temperature = float(body.get("temperature", 0.0))
        max_new = int(body.get("max_new_tokens", 256))
        seed = body.get("seed")
        seed = None if seed in (None, "") else int(seed)
    except (TypeError, ValueError):
        raise TalkError("temperature, max_new_tokens and seed must be numbers") from None
    if not math.isfinite(temperature) or not 0 <= temperature <= 2:
        raise TalkError(f"temperature {temperature}: between 0 (greedy) and 2, as `mudpuppy serve` takes it")
    if not 1 <= max_new <= MAX_TOKENS:
        raise TalkError(f"max_new_tokens {max_new}: between 1 and {MAX_TOKENS} (serve's --max-tokens)")
    return GenerationOptions(max_new_tokens=max_new, temperature=temperature, seed=seed)


def conversation_of(body: dict) -> tuple[list[dict], str]:
    """(the turns before it, the user's new message) from the pane's messages: user and assistant turns,
    alternating, ending with the user's."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TalkError("messages: a list of {role, content} turns, the last one the user's")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise TalkError(f"messages[{i}]: a turn is {{\"role\": \"user\" or \"assistant\", \"content\": text}}")
        if m["role"] != ROLES[i % 2]:
            raise TalkError(f"messages[{i}]: turns alternate user, assistant, user, ...")
    if messages[-1]["role"] != "user":
        raise TalkError("messages: the last turn must be the user's")
    return [dict(role=m["role"], content=m["content"]) for m in messages[:-1]], messages[-1]["content"]


class Talk:
    """The models the pane talks to: one run's at a time, loaded on its first message."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.lock = threading.Lock()          # one answer at a time: the loaded model is one
        self.run: str | None = None           # the run whose models are held
        self.models: dict[str, object] = {}   # "run" / "base" -> ChatModel

    def held(self) -> dict:
        return {"run": self.run, "sides": sorted(self.models)}

    def _model(self, run: str, side: str, say):
        folder = inside(self.root, run)
        name = relative_name(self.root, folder)
        if not (folder / "run_summary.json").is_file():
            raise TalkError(f"{name}: not a finished run (no run_summary.json); the chat pane talks to finished runs")
        if self.run != name and self.models:
            say(f"freed {self.run} ({', '.join(sorted(self.models))}): one run's models are held at a time")
            self.models.clear()
            gc.collect()
        self.run = name
        if side not in self.models:
            say(f"loading {name}{' (its base model)' if side == 'base' else ''} ...")
            if side == "run":
                self.models[side] = load_chat_model(str(folder), None, "auto", name=name)
            else:
                self.models[side] = load_chat_model(str(folder), None, "auto", name=f"base of {name}", base=True)
            model = self.models[side]
            say(f"loaded: {model.description}; backend {model.backend.name} on {model.backend.device}")
        return self.models[side]

    def reply(self, run: str, side: str, body: dict, say, on_text) -> dict:
        """One answer of `side` ("run" or "base") of `run` to the conversation in `body`, its text passed to
        `on_text` as it is generated; `say` gets what the pane should tell the user (loading, freeing)."""
        if side not in ("run", "base"):
            raise TalkError(f"side {side!r}: run or base")
        history, text = conversation_of(body)
        options = options_of(body)
        system = body.get("system")
        if system is not None and not isinstance(system, str):
            raise TalkError("system: text")
        with self.lock:
            model = self._model(run, side, say)
            session = ChatSession(model, options, system or model.system_prompt, messages=history)
            try:
                completion = session.reply(text, on_text)
            except ContextExceeded as exc:
                raise TalkError(f"{exc} Shorten the message, or clear the conversation.") from None
        return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
                "finish_reason": completion.finish_reason, "seconds": round(completion.seconds, 3),
                "seconds_to_first_token": completion.seconds_to_first_token}
