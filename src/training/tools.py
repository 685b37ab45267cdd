"""GRPO's tools: the user's functions offered to the model, its calls read back, and the calls run.

A tool is a plain Python function (sync or async) named as a reward function is
(`path/to/file.py:function` or `package.module:function`); its JSON schema comes
from its type hints and its Google-style docstring (transformers' get_json_schema,
what `apply_chat_template(tools=...)` does with a function), so a tool without
either is refused before the model loads, naming the file and the function.

The schemas reach the prompt the way the data pipeline renders tools
(data/tools.py): through the chat template where it renders them, else in a
built-in format (hermes: Qwen2.5 / Hermes 2 Pro tags; llama3: Llama 3.1 JSON).
A sampled turn is read back in the same format (`parse_turn`), and each tool
result is written back as the format wants it (`result_messages`).

Calls run as TRL 1.16's GRPOTrainer runs them (`_tool_call_loop`): `fn(**arguments)`;
whatever it returns is the tool message's content (`str(result)`, a string as
is), an exception becomes `{'error': '<message>'}` and counts as a failure, and
the rollout goes on. Two additions: each call has a time limit (`tool_timeout`,
a call past it is a failure whose thread is left to finish in the background,
since Python cannot stop a thread), and a call the model wrote but that does
not parse (bad JSON, no name) is answered with an error message too, instead of
ending the rollout silently.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..data.tools import BUILTIN_TOOL_FORMATS, to_builtin_format
from ..errors import MudpuppyError
from ..rewards.imports import import_function
from ..rewards.specs import function_spec


class ToolError(MudpuppyError):
    """A tool or environment that cannot be used as configured."""


@dataclass
class Tool:
    name: str
    fn: Callable
    schema: dict            # {"type": "function", "function": {name, description, parameters}}
    source: str             # how the config named it, for messages


@dataclass
class Call:
    """One call as the model wrote it; `error` when it could not be read (then it is answered with it)."""

    name: str
    arguments: dict
    error: str | None = None

    def as_message_call(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Turn:
    """A sampled assistant turn read back: its text without the calls, and the calls (none: the last turn)."""

    content: str
    calls: list[Call]

    def message(self) -> dict:
        msg = {"role": "assistant", "content": self.content}
        if self.calls:
            msg["tool_calls"] = [c.as_message_call() for c in self.calls]
        return msg


# --------------------------------------------------------------------------- loading

def schema_of(fn: Callable, where: str) -> dict:
    """The function's JSON schema, as a chat template receives it; one message naming `where` if it has none."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:   # DocstringParsingException, TypeHintParsingException
        raise ToolError(f"{where}: a tool needs a docstring and type hints for every argument (its schema, which "
                        f"the model reads, is built from them, with an 'Args:' section describing each argument): "
                        f"{exc}") from None


def load_tools(entries: list[str], source_dir: str | None) -> list[Tool]:
    """`grpo.tools` as Tools, every entry's problem reported together."""
    tools, problems, modules = [], [], {}
    for i, entry in enumerate(entries):
        where = f"grpo.tools[{i}] ({entry})"
        spec = function_spec(entry)
        if spec is None:
            problems.append(f"{where}: write a tool as 'path/to/file.py:function' or 'package.module:function'")
            continue
        try:
            fn = import_function(spec, source_dir, modules, role=f"grpo.tools[{i}]")
            tools.append(Tool(fn.__name__, fn, schema_of(fn, where), entry))
        except MudpuppyError as exc:
            problems.append(str(exc))
    check_unique(tools, problems)
    if problems:
        raise ToolError("\n".join(problems))
    return tools


def check_unique(tools: list[Tool], problems: list[str]) -> None:
    seen: dict[str, str] = {}
    for t in tools:
        if t.name in seen:
            problems.append(f"two tools are called {t.name!r} ({seen[t.name]} and {t.source}); the model calls "
                            "tools by name, so each name must be unique")
        seen.setdefault(t.name, t.source)


# --------------------------------------------------------------------------- reading the model's calls

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_turn(text: str, fmt: str) -> Turn:
    """A sampled turn (special tokens removed) read in tool format `fmt` (hermes, llama3, or the
    template's own syntax, which `template_syntax` found to be one of those two)."""
    if fmt == "llama3":
        return _parse_llama3(text)
    return _parse_hermes(text)


def _parse_hermes(text: str) -> Turn:
    start = text.find("<tool_call>")
    if start < 0:
        return Turn(text, [])
    calls = [_read_call(m.group(1), ("arguments", "parameters")) for m in _HERMES.finditer(text, start)]
    return Turn(text[:start].rstrip(), calls)


def _parse_llama3(text: str) -> Turn:
    body = text.strip()
    if not body.startswith("{"):
        return Turn(text, [])
    call = _read_call(body, ("parameters", "arguments"))
    if call.error and '"name"' not in body:   # JSON-looking text that is no call at all: an answer
        return Turn(text, [])
    return Turn("", [call])


def _read_call(body: str, keys: tuple[str, str]) -> Call:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return Call("unknown", {}, f"the tool call is not valid JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return Call("unknown", {}, 'the tool call must be a JSON object with a "name" and its arguments')
    args = data.get(keys[0], data.get(keys[1], {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return Call(data["name"], {}, "the tool call's arguments are a string but not JSON")
    if not isinstance(args, dict):
        return Call(data["name"], {}, "the tool call's arguments must be a JSON object")
    return Call(data["name"], args)


def template_syntax(tokenizer) -> str:
    """How the chat template writes a call: 'hermes' (<tool_call> tags) or 'llama3' (bare JSON),
    found by rendering one; a template writing calls some other way is refused."""
    from ..data.render import render_chat

    probe = {"type": "function", "function": {"name": "mudpuppy_probe", "arguments": {"x": 1}}}
    text = render_chat(tokenizer, [{"role": "user", "content": "probe"},
                                   {"role": "assistant", "content": "", "tool_calls": [probe]}])
    if "<tool_call>" in text:
        return "hermes"
    if re.search(r'\{\s*"name":\s*"mudpuppy_probe"', text):
        return "llama3"
    raise ToolError("grpo.tools: this model's chat template writes tool calls in a form mudpuppy cannot read back "
                    "from sampled text (neither <tool_call> tags nor a JSON object); set the dataset's tool_format "
                    "to hermes or llama3 to offer the tools in a built-in format")


# --------------------------------------------------------------------------- writing results back

def result_messages(fmt: str, turn: Turn, results: list[tuple[str, str]]) -> tuple[dict, list[dict]]:
    """(the assistant message that made the calls, the tool messages) as format `fmt` renders them: the
    template's own messages, or the built-in format's text as the data pipeline writes it (to_builtin_format)."""
    messages = [turn.message()] + [{"role": "tool", "name": name, "content": content} for name, content in results]
    if fmt in BUILTIN_TOOL_FORMATS:
        messages, _, _ = to_builtin_format(fmt, messages, [False] * len(messages), None)
    return messages[0], messages[1:]


def suffix_ids(tokenizer, call_message: dict, tool_messages: list[dict], stop_ids: set[int]) -> list[int]:
    """The tokens that follow a sampled calling turn: the tool results and the next assistant header.

    TRL's `_get_tool_suffix_ids`: render a dummy conversation ending in the calling turn, and the
    same with the results and a generation prompt; the difference is the suffix. The first is cut
    after its last end-of-turn token, which the sampled turn ends with too."""
    from ..data.render import render_chat

    dummy = [{"role": "user", "content": "dummy"}, call_message]
    prefix = tokenizer(render_chat(tokenizer, dummy), add_special_tokens=False)["input_ids"]
    full = tokenizer(render_chat(tokenizer, dummy + tool_messages, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
    ends = [i for i, t in enumerate(prefix) if t in stop_ids]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ToolError("the chat template renders a tool-calling turn differently once tool results follow it, so "
                        "the results cannot be appended to the sampled tokens; set the dataset's tool_format to "
                        "hermes or llama3")
    return full[len(prefix):]


# --------------------------------------------------------------------------- running calls

def run_call(call: Call, tools: dict[str, Callable], timeout: float) -> tuple[str, bool]:
    """(the tool message's content, failed) for one call, never raising."""
    if call.error:
        return str({"error": call.error}), True
    fn = tools.get(call.name)
    if fn is None:
        return str({"error": f"Tool {call.name} not found."}), True
    box: dict = {}

    def target():
        try:
            out = fn(**call.arguments)
            if inspect.isawaitable(out):
                out = asyncio.run(_await(out))
            box["out"] = out
        except BaseException as exc:   # the tool's failure is the model's feedback, never the run's end
            box["exc"] = exc

    worker = threading.Thread(target=target, name=f"tool-{call.name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return str({"error": f"the tool did not answer within {timeout:g} s"}), True
    if "exc" in box:
        return str({"error": str(box["exc"]) or type(box["exc"]).__name__}), True
    out = box.get("out")
    return (out if isinstance(out, str) else str(out)), False


async def _await(awaitable):
    return await awaitable
