"""A /v1/chat/completions body checked into what to generate, or an OpenAI error.

Nothing a client sends may reach the model unchecked: bodies that are not JSON objects,
JSON nested beyond MAX_DEPTH (Python's parser recurses), strings that are not Unicode text
(a lone surrogate such as "\\ud800" cannot be tokenized), NaN and infinities, seeds beyond
64 bits, and token counts the model cannot hold. Each is a 400 naming the field.

Token limits, as OpenAI applies them: a prompt that fills the model's context is refused
(400 context_length_exceeded; messages longer than the context could hold in characters are
refused so before they are tokenized), and so is a max_tokens above what the context leaves after
the prompt, or above the server's cap (--max-tokens). A request without max_tokens gets the
server's default, cut to what the context leaves.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from .engine import GenerationOptions

MAX_DEPTH = 64
MAX_STOP = 512                            # characters in one stop string
SEED_RANGE = (-2**63, 2**63 - 1)          # what OpenAI documents (int64); torch and MLX wrap it to 64 bits
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    messages: list[dict]
    options: GenerationOptions
    stream: bool
    include_usage: bool
    max_tokens: tuple[str, int] | None     # (the field that set it, its value), None when left out


# --------------------------------------------------------------------------- JSON

def load_json(raw: bytes) -> dict:
    def refuse_constant(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=refuse_constant)
    except RecursionError:
        raise too_deep() from None
    except (UnicodeDecodeError, ValueError) as exc:    # JSONDecodeError, NaN, ints beyond Python's digit limit
        raise RequestError(400, f"We could not parse the JSON body of your request ({exc}). The body must be "
                                "a JSON object.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"The request body must be a JSON object, got {kind(body)}.", code="invalid_json")
    check_tree(body)
    return body


def check_tree(body) -> None:
    """Depth at most MAX_DEPTH and every string (keys too) valid Unicode, walked without recursion."""
    todo = [(body, 1)]
    while todo:
        value, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise too_deep()
        if isinstance(value, dict):
            for key, item in value.items():
                text_or_400(key)
                todo.append((item, depth + 1))
        elif isinstance(value, list):
            todo.extend((item, depth + 1) for item in value)
        elif isinstance(value, str):
            text_or_400(value)


def text_or_400(value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(400, "The request body holds a string that is not valid Unicode (a lone surrogate "
                                "such as \\ud800).", code="invalid_json") from None


def too_deep() -> RequestError:
    return RequestError(400, f"The JSON body is nested too deeply (the limit is {MAX_DEPTH} levels).",
                        code="invalid_json")


# --------------------------------------------------------------------------- fields

def parse_chat_request(body: dict, served: str, defaults: GenerationOptions) -> ChatRequest:
    model = body.get("model")
    if model is not None and model != served:
        raise RequestError(404, f"The model `{model}` does not exist; this server serves `{served}`.", "model",
                           "model_not_found")
    messages = parse_messages(body.get("messages"))
    max_tokens = None
    for key in ("max_tokens", "max_completion_tokens"):     # the newer name wins when both are there
        value = integer(body, key, None, 1, 2**63 - 1)
        if value is not None:
            max_tokens = (key, value)
    options = replace(
        defaults,
        temperature=number(body, "temperature", defaults.temperature, 0.0, 2.0),
        top_p=number(body, "top_p", defaults.top_p, 0.0, 1.0, low_open=True),
        top_k=integer(body, "top_k", defaults.top_k, 0, 2**31 - 1),
        seed=integer(body, "seed", defaults.seed, *SEED_RANGE),
        stop=parse_stop(body.get("stop")),
    )
    if body.get("n", 1) != 1:
        raise RequestError(400, "Only n=1 is supported.", "n", "unsupported_value")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(400, f"Invalid type for 'stream': expected a boolean, got {kind(stream)}.", "stream",
                           "invalid_type")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError(400, "Invalid type for 'stream_options': expected an object.", "stream_options",
                           "invalid_type")
    return ChatRequest(messages, options, stream, bool(stream_options.get("include_usage")), max_tokens)


def apply_limits(request: ChatRequest, prompt_tokens: int, context: int | None, cap: int) -> GenerationOptions:
    """The options with max_new_tokens decided, or a 400 when the prompt or max_tokens does not fit."""
    room = cap if context is None else min(cap, context - prompt_tokens)
    if context is not None and prompt_tokens >= context:
        raise RequestError(400, f"This model's maximum context length is {context} tokens. However, your messages "
                                f"resulted in {prompt_tokens} tokens. Please reduce the length of the messages.",
                           "messages", "context_length_exceeded")
    if request.max_tokens is None:
        return replace(request.options, max_new_tokens=max(1, min(request.options.max_new_tokens, room)))
    key, wanted = request.max_tokens
    if wanted > cap:
        raise RequestError(400, f"{key} is too large: {wanted}. This server allows at most {cap} completion "
                                "tokens (--max-tokens).", key, "invalid_value")
    if context is not None and prompt_tokens + wanted > context:
        raise RequestError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                                f"{prompt_tokens + wanted} tokens ({prompt_tokens} in the messages, {wanted} in the "
                                f"completion). Please reduce the length of the messages or completion.",
                           key, "context_length_exceeded")
    return replace(request.options, max_new_tokens=wanted)


def parse_messages(value) -> list[dict]:
    if value is None:
        raise RequestError(400, "Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise RequestError(400, "'messages' must be a non-empty array of {role, content} objects.", "messages",
                           "invalid_type")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise RequestError(400, f"Invalid type for '{where}': expected an object.", where, "invalid_type")
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise RequestError(400, f"Invalid value for '{where}.role': {role!r}; supported: "
                                    f"{', '.join(ROLES)}.", f"{where}.role", "invalid_value")
        out.append({"role": ROLES[role], "content": message_text(msg.get("content"), f"{where}.content")})
    return out


def message_text(content, where: str) -> str:
    """A string, or OpenAI's content parts of type text, joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"Invalid content part in '{where}': only text parts are supported.", where,
                                   "invalid_value")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(400, f"Invalid type for '{where}': expected a string or an array of text parts, got "
                            f"{kind(content)}.", where, "invalid_type")


def parse_stop(value) -> tuple[str, ...]:
    """Up to 4 strings of at most MAX_STOP characters: each token's text is checked against every way each
    stop string could start at its end (text.TextStream.held_back), which costs the square of its length."""
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if isinstance(stops, list) and len(stops) <= 4 and all(isinstance(s, str) for s in stops):
        if any(len(s) > MAX_STOP for s in stops):
            raise RequestError(400, f"Invalid value for 'stop': each stop string may hold at most {MAX_STOP} "
                                    "characters.", "stop", "invalid_value")
        return tuple(stops)
    raise RequestError(400, "Invalid value for 'stop': expected a string or an array of up to 4 strings.", "stop",
                       "invalid_value")


def number(body: dict, key: str, default, low: float, high: float, low_open: bool = False):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(400, f"Invalid type for '{key}': expected a number, got {kind(value)}.", key, "invalid_type")
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        span = f"{'above' if low_open else 'at least'} {low:g} and at most {high:g}"
        raise RequestError(400, f"Invalid value for '{key}': {value}; it must be {span}.", key, "invalid_value")
    return float(value)


def integer(body: dict, key: str, default, low: int, high: int):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"Invalid type for '{key}': expected an integer, got {kind(value)}.", key,
                           "invalid_type")
    if value < low:
        raise RequestError(400, f"Invalid value for '{key}': {value}; it must be at least {low}.", key,
                           "invalid_value")
    if value > high:
        raise RequestError(400, f"Invalid value for '{key}': {value}; it must be at most {high}.", key,
                           "invalid_value")
    return value


def kind(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), type(value).__name__)
