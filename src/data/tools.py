"""Tool calling and content parts: checking them in records, and the built-in tool formats.

Records carry tools the way OpenAI-style exports write them: a `tools` column
(a list of JSON schemas) and assistant messages with `tool_calls`
(``[{"type": "function", "function": {"name": ..., "arguments": {...}}}]``,
the arguments a dict or a JSON string). Both are checked and brought to one
shape here: tools as ``{"type": "function", "function": {...}}``, arguments as
a dict (what transformers' chat templates expect: they write them with
``tojson``).

A conversation with tool calls is rendered by the tokenizer's own template
when it renders them (`template_tool_support` finds out by rendering a
probe), otherwise by rewriting the tool parts as plain message text in one of
the built-in formats below and rendering that with the chat template:

    hermes   Qwen2.5 / Hermes 2 Pro: tools in the system message inside <tools></tools>,
             each call as <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>,
             each result as <tool_response>\\n...\\n</tool_response>
    llama3   Llama 3.1 JSON tool calling: tools in the first user message, one call per
             assistant turn as {"name": ..., "parameters": {...}}, results in the ipython role
"""

from __future__ import annotations

import json

TOOL_FORMATS = ("auto", "template", "hermes", "llama3")
BUILTIN_TOOL_FORMATS = ("hermes", "llama3")
TEXT_PART_TYPES = ("text", "input_text", "output_text")
IMAGE_PART_TYPES = ("image", "image_url", "input_image")


class RecordError(ValueError):
    """A record that cannot be rendered as written; the caller adds the file and line."""


# --------------------------------------------------------------------------- checking records

def join_content_parts(parts: list, where: str, images: bool = False) -> str:
    """Text parts joined with nothing between them, as transformers' chat templates do
    (``{% for part in content %}{% if part.type == 'text' %}{{ part.text }}``). Image parts are
    skipped with `images` (a vision-language model: formats.image_parts keeps them), refused otherwise."""
    texts = []
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise ValueError(f"{at} must be a content part such as {{'type': 'text', 'text': ...}}, found {_show(part)}")
        kind = part.get("type", "text" if "text" in part else None)
        if kind in IMAGE_PART_TYPES or (kind is None and ("image" in part or "image_url" in part)):
            if images:
                continue
            raise ValueError(f"{at} is an image part; images are read by vision-language models, in chat records, "
                             "and this is a text-only model (or not a chat record): remove the image parts, use "
                             "text-only data, or train a vision-language model on chat records (set model.vision: "
                             "true if base_model is one; docs/data.md#images)")
        if kind not in TEXT_PART_TYPES:
            raise ValueError(f"{at} has type {kind!r}; only text parts (type 'text') can be used here")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{at}.text must be a string, found {_show(part.get('text'))}")
        texts.append(part["text"])
    return "".join(texts)


def check_tool_calls(calls, where: str) -> list[dict]:
    """OpenAI-shaped calls ({"function": {"name", "arguments"}}, or {"name", "arguments"} directly),
    each as {"type": "function", "function": {"name": str, "arguments": dict}} (plus its "id")."""
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list of calls, found {_show(calls)}")
    out = []
    for k, call in enumerate(calls):
        at = f"{where}[{k}]"
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise ValueError(f"{at} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': {{...}}}}}}, "
                             f"found {_show(call)}")
        clean = {"type": "function", "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"), at)}}
        if isinstance(call.get("id"), str):
            clean["id"] = call["id"]
        out.append(clean)
    return out


def _arguments(value, at: str) -> dict:
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{at}.function.arguments is a string but not JSON ({exc.msg} at column {exc.colno}): "
                             f"{_show(value)}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{at}.function.arguments must be an object (or a JSON string of one), found {_show(value)}")
    return value


def check_tools(value, key: str = "tools") -> list[dict] | None:
    """The `tools` column: a list of JSON schemas (or a JSON string of one, as CSV and Parquet
    exports store it), each as {"type": "function", "function": {"name", ...}}; None when empty."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise ValueError(f"field {key!r} is a string but not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(value, list):
        raise ValueError(f"field {key!r} must be a list of tool schemas, found {_show(value)}")
    out = []
    for k, tool in enumerate(value):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{key}[{k}] must be a JSON schema {{'type': 'function', 'function': {{'name': ..., "
                             f"'parameters': {{...}}}}}}, found {_show(tool)}")
        out.append({"type": "function", "function": fn})
    return out or None


def uses_tools(record: dict) -> bool:
    """Whether a normalized record has tool schemas or tool calls anywhere."""
    if record.get("tools"):
        return True
    for key in ("messages", "prompt", "completion", "chosen", "rejected"):
        value = record.get(key)
        if isinstance(value, list) and any(m.get("tool_calls") for m in value):
            return True
    return False


def _show(value) -> str:
    if value is None:
        return "nothing (null or absent)"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


# --------------------------------------------------------------------------- which format

_PROBE_TOOL = "mudpuppy_probe_schema"
_PROBE_CALL = "mudpuppy_probe_call"


def template_tool_support(tokenizer) -> tuple[bool, bool]:
    """(renders tool calls, renders tool schemas) for the tokenizer's chat template, found by rendering."""
    schema = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}
    call = {"type": "function", "function": {"name": _PROBE_CALL, "arguments": {"probe_argument": 1}}}
    messages = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "probe result"}, {"role": "assistant", "content": "done"}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[schema], tokenize=False)
    except Exception:   # a template that raises on tools (raise_exception, missing keys) does not support them
        return False, False
    return _PROBE_CALL in text, _PROBE_TOOL in text


def resolve_tool_format(tokenizer, choice: str, with_schemas: bool) -> str:
    """`template`, `hermes` or `llama3` for data with tool calls under the `tool_format` setting."""
    if choice != "auto":
        return choice
    calls, schemas = template_tool_support(tokenizer)
    if calls and (schemas or not with_schemas):
        return "template"
    probe = tokenizer.apply_chat_template([{"role": "user", "content": "probe"}], tokenize=False)
    return "llama3" if "<|start_header_id|>" in probe else "hermes"


# --------------------------------------------------------------------------- built-in formats

_HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)

_LLAMA3_TOOLS = (
    "Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    "Do not use variables.\n\n"
)


def hermes_call(call: dict) -> str:
    fn = call["function"]
    return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False) \
        + "\n</tool_call>"


def llama3_call(call: dict) -> str:
    fn = call["function"]
    return json.dumps({"name": fn["name"], "parameters": fn["arguments"]}, ensure_ascii=False)


def to_builtin_format(fmt: str, messages: list[dict], trained: list[bool], tools: list[dict] | None):
    """(messages, trained, origin) with the tool parts written as plain text in `fmt`;
    origin[k] is the index of the record's message that message k comes from (None: added)."""
    convert = _to_hermes if fmt == "hermes" else _to_llama3
    out = [convert(i, m) for i, m in enumerate(messages)]
    trained, origin = list(trained), list(range(len(messages)))
    if tools:
        out, trained, origin = (_hermes_tools if fmt == "hermes" else _llama3_tools)(out, trained, origin, tools)
    return out, trained, origin


def _to_hermes(i: int, m: dict) -> dict:
    if m.get("tool_calls"):
        text = "\n".join(hermes_call(c) for c in m["tool_calls"])
        return {"role": m["role"], "content": (m["content"] + "\n" if m["content"] else "") + text}
    if m["role"] == "tool":
        return {"role": "tool", "content": "<tool_response>\n" + m["content"] + "\n</tool_response>"}
    return {"role": m["role"], "content": m["content"]}


def _to_llama3(i: int, m: dict) -> dict:
    calls = m.get("tool_calls")
    if calls:
        if len(calls) > 1:
            raise RecordError(f"messages[{i}] makes {len(calls)} tool calls in one turn; Llama 3.1's format has one "
                              "call per assistant turn (split them into turns, or set tool_format: hermes)")
        if m["content"].strip():
            raise RecordError(f"messages[{i}] has both text and a tool call; Llama 3.1's format writes only the call, "
                              "so the text would be lost (move it to its own assistant turn, or set tool_format: hermes)")
        return {"role": "assistant", "content": llama3_call(calls[0])}
    if m["role"] == "tool":
        return {"role": "ipython", "content": m["content"]}
    return {"role": m["role"], "content": m["content"]}


def _hermes_tools(messages, trained, origin, tools):
    block = _HERMES_TOOLS.format(tools="".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + block}
        return messages, trained, origin
    return [{"role": "system", "content": block}] + messages, [False] + trained, [None] + origin


def _llama3_tools(messages, trained, origin, tools):
    first_user = next((k for k, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise RecordError("Llama 3.1's tool format puts the tools in the first user message, and this "
                          "conversation has no user message (set tool_format: hermes)")
    schemas = "".join(json.dumps(t, indent=4, ensure_ascii=False) + "\n\n" for t in tools)
    user = messages[first_user]
    messages[first_user] = {**user, "content": _LLAMA3_TOOLS + schemas + user["content"]}
    env = "Environment: ipython"
    if messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": env + "\n\n" + messages[0]["content"]}
        return messages, trained, origin
    return [{"role": "system", "content": env}] + messages, [False] + trained, [None] + origin
