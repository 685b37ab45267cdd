"""Records to text, with the character spans whose tokens carry loss.

Masks are decided on characters, then mapped to tokens once (`tokenize.py`).
For chat, a trained turn's span is found by rendering the conversation's
first i messages (with the generation prompt, so the assistant header stays
out) and the first i+1: the text between is what the template adds for turn
i. Inside it, the message's own content is the "content" span and what the
template closes the turn with (``<|im_end|>``, ``<|eot_id|>``, ``</s>``)
is the "eos" span: training on it is how a model learns to stop. A token
carries loss when it starts inside a span, so a token that begins in the
prompt never does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import DataError
from .chat_render import FRAMES_KEPT, ConversationRenderer, apply_template, template_message
from .tools import BUILTIN_TOOL_FORMATS, RecordError, to_builtin_format

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
PRM_STEP_SEPARATOR = "\n"


@dataclass(frozen=True)
class RenderOptions:
    """How one dataset's records become text; built from its DatasetSpec."""

    roles: frozenset[str] = frozenset({"assistant"})
    train_on_inputs: bool = False
    train_on_eos: str = "turn"          # turn | last | none
    chat: bool = True                   # prompt/response formats through the chat template
    system_prompt: str | None = None
    tool_format: str = "auto"           # auto | template | hermes | llama3 (see tools.py)


@dataclass
class Rendered:
    text: str
    spans: list[tuple[int, int, str]] = field(default_factory=list)   # (start, end, "content" | "eos")
    add_special_tokens: bool = False    # raw text: let the tokenizer add its BOS; templates write their own
    append_eos: bool = False            # raw text: end with the tokenizer's EOS token
    anchors: list[int] = field(default_factory=list)   # PRM: character index of each step's last character
    images: tuple[str, ...] = ()        # vision-language chat: the image files, in order (vision.py)
    blocked: list[tuple[int, int]] = field(default_factory=list)   # image runs: never carry loss

    def trained_spans(self, train_on_eos: str) -> list[tuple[int, int]]:
        """Spans that carry loss under the EOS policy, sorted and non-empty."""
        eos = [s for s in self.spans if s[2] == "eos"]
        keep_eos = {"turn": eos, "last": eos[-1:]}.get(train_on_eos, [])
        return sorted((a, b) for a, b, kind in self.spans if b > a and (kind == "content" or (a, b, kind) in keep_eos))


# --------------------------------------------------------------------------- chat

def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False,
                tools: list[dict] | None = None) -> str:
    return apply_template(tokenizer, [template_message(m) for m in messages], add_generation_prompt, tools)


def render_conversation(tokenizer, messages: list[dict], trained: list[bool], tools: list[dict] | None = None,
                        tool_format: str = "auto") -> Rendered:
    """The rendered conversation with a content span and an eos span per trained message.

    Tool results never carry loss. With a built-in `tool_format` the tool parts are first
    rewritten as message text (`tools.to_builtin_format`); otherwise they go to the template.
    Raises RecordError when the template would leave out something the record holds.
    """
    trained = [t and m["role"] != "tool" for m, t in zip(messages, trained)]
    origin = list(range(len(messages)))
    if tool_format in BUILTIN_TOOL_FORMATS:
        messages, trained, origin = to_builtin_format(tool_format, messages, trained, tools)
        tools = None
    chat = ConversationRenderer(tokenizer, messages, tools)
    full = chat.prefix(len(messages))
    check_nothing_vanishes(full, messages, origin)
    spans: list[tuple[int, int, str]] = []
    for i, msg in enumerate(messages):
        if not trained[i]:
            continue
        assistant = msg["role"] == "assistant"
        before = chat.prefix(i, add_generation_prompt=assistant) if i else ""
        upto = chat.prefix(i + 1)
        if not full.startswith(upto) or not upto.startswith(before):
            raise DataError(
                "chat template", None,
                "this chat template does not render a conversation's first turns as a prefix of the whole "
                "(some templates rewrite earlier turns), so loss masks cannot be derived from it; "
                "set data.chat_template to a built-in template such as chatml")
        if msg.get("tool_calls"):
            spans += call_turn_spans(chat, messages, i, full, len(before), len(upto), origin[i])
            continue
        frame = turn_frame(chat, messages, i, full[len(before):len(upto)], len(before))
        spans += turn_spans(full, len(before), len(upto), msg["content"], frame, after_prompt=assistant)
    return Rendered(full, spans)


def check_nothing_vanishes(full: str, messages: list[dict], origin: list[int | None]) -> None:
    """Every message's text and every tool call's name must appear in the rendered text:
    a template that drops them would otherwise train on a conversation the record does not hold."""
    for msg, at in zip(messages, origin):
        where = f"messages[{at}] ({msg['role']})" if at is not None else "the tool list"
        # A message with images is checked part by part: its joined text has no image between.
        texts = [p["text"].strip() for p in msg.get("parts", ()) if p["type"] == "text"] or [msg["content"].strip()]
        text = next((t for t in texts if t and t not in full), "")
        if text:
            hint = (" (this template writes only the tool call of a turn that has one: move the text to its own "
                    "assistant turn, or set tool_format: hermes)" if msg.get("tool_calls") else "")
            raise RecordError(f"{where}: the chat template leaves this message's text out of the rendered "
                              f"conversation, so it would be silently dropped{hint}")
        for call in msg.get("tool_calls", ()):
            if call["function"]["name"] not in full:
                raise RecordError(f"{where}: the chat template does not render tool_calls, so the call to "
                                  f"{call['function']['name']!r} would vanish and the turn would train on nothing; "
                                  "set tool_format: hermes or llama3 to write calls in a built-in format")


def call_turn_spans(chat: ConversationRenderer, messages: list[dict], i: int, full: str, lo: int, hi: int,
                    at: int | None) -> list[tuple[int, int, str]]:
    """Spans of an assistant turn the template renders with its tool calls: everything the turn
    writes after the generation prompt is content, up to the marker that closes a plain
    assistant turn (learnt by rendering one with a placeholder), which is the eos span."""
    probe = chat.probe(i, {"role": "assistant", "content": SENTINEL})
    pos = probe.find(SENTINEL)
    marker = probe[pos + len(SENTINEL):].rstrip() if pos >= lo else ""
    end = lo + len(full[lo:hi].rstrip())
    c1 = end - len(marker) if marker and full[lo:end].endswith(marker) else end
    for call in messages[i]["tool_calls"]:
        if call["function"]["name"] not in full[lo:c1]:
            raise RecordError(f"messages[{at}] (assistant): the chat template does not write the call to "
                              f"{call['function']['name']!r} inside the assistant turn, so it would carry no loss; "
                              "set tool_format: hermes or llama3")
    spans = [(lo, c1, "content")] if c1 > lo else []
    if end > c1:
        spans.append((c1, end, "eos"))
    return spans


# Private-use characters: no template writes them, and a record containing them
# only loses the exact frame (the content search below still applies).
SENTINEL = "\ue000\ue001"


def turn_frame(chat: ConversationRenderer, messages: list[dict], i: int, region: str,
               lo: int) -> tuple[str, str] | None:
    """(what the template writes before turn i's content, what after), learnt by rendering
    the turn with a sentinel as its content; None when the template hides it.

    Most conversations of a dataset share their turns' frames, so a frame is remembered per
    conversation shape (`ConversationRenderer.frame_key`) and used again, without the probe,
    only where this turn's rendered text is exactly that frame around this turn's content."""
    key = chat.frame_key(i)
    content = messages[i]["content"]
    known = chat.frames.get(key) if key is not None else None
    if known is not None and region == known[0] + content + known[1]:
        return known
    probe = chat.probe(i, {**messages[i], "content": SENTINEL})
    at = probe.find(SENTINEL)
    if at < lo:
        return None
    frame = probe[lo:at], probe[at + len(SENTINEL):]
    if key is not None and region == frame[0] + content + frame[1]:
        if len(chat.frames) >= FRAMES_KEPT:
            chat.frames.clear()
        chat.frames[key] = frame
    return frame


def turn_spans(full: str, lo: int, hi: int, content: str, frame: tuple[str, str] | None,
               after_prompt: bool) -> list[tuple[int, int, str]]:
    """Split the text turn [lo, hi) adds into its content and its closing marker.

    The content lies between the turn's frame (header before, marker after);
    when the frame does not fit (content the template rewrites), the content
    is searched from the end instead. With `after_prompt` (assistant turns:
    `lo` is where the generation prompt ends) everything from `lo` is what
    the model must produce, so the content span starts there; otherwise it
    starts at the content, with the spaces before it, which word tokens
    carry. Everything after the content up to and including the marker
    (``<|im_end|>``, `` </s>``) is the eos span; whitespace after the marker
    is not trained: generation stops at the marker.
    """
    region = full[lo:hi]
    if frame is not None and region.startswith(frame[0]) and region.endswith(frame[1]) \
            and len(frame[0]) + len(frame[1]) <= len(region):
        c0, c1 = lo + len(frame[0]), hi - len(frame[1])
    else:
        text = content.strip()
        pos = region.rfind(text) if text else -1
        if pos < 0:
            return [(lo, hi, "content")] if text else []
        c0, c1 = lo + pos, lo + pos + len(text)
    start = lo if after_prompt else c0 - (len(full[lo:c0]) - len(full[lo:c0].rstrip(" ")))
    spans = [(start, c1, "content")] if c1 > start else []
    marker_end = c1 + len(full[c1:hi].rstrip())
    if marker_end > c1:
        spans.append((c1, marker_end, "eos"))
    return spans


def trained_flags(messages: list[dict], opts: RenderOptions) -> list[bool]:
    """A message's own ``train`` flag wins; otherwise its role decides. Tool results never train."""
    return [m["role"] != "tool" and m.get("train", opts.train_on_inputs or m["role"] in opts.roles)
            for m in messages]


# --------------------------------------------------------------------------- prompt / response

def as_messages(value: str | list[dict], role: str) -> list[dict]:
    return value if isinstance(value, list) else [{"role": role, "content": value}]


def render_prompt_response(tokenizer, prompt: str | list[dict], response: str | list[dict],
                           opts: RenderOptions, raw_prompt: str | None = None,
                           tools: list[dict] | None = None) -> Rendered:
    """A prompt and a response: through the chat template, or as plain concatenated text.

    Message lists always use the template; for plain strings `opts.chat`
    decides. `raw_prompt` replaces the prompt text in plain rendering (the
    Alpaca layout for instructions).
    """
    use_chat = opts.chat or isinstance(prompt, list) or isinstance(response, list)
    if use_chat:
        system = [{"role": "system", "content": opts.system_prompt}] if opts.system_prompt else []
        head = system + as_messages(prompt, "user")
        tail = as_messages(response, "assistant")
        messages = head + tail
        trained = [m.get("train", opts.train_on_inputs) for m in head] + [m.get("train", True) for m in tail]
        return render_conversation(tokenizer, messages, trained, tools, opts.tool_format)
    prompt_text = raw_prompt if raw_prompt is not None else prompt
    text = prompt_text + response
    start = 0 if opts.train_on_inputs else len(prompt_text)
    return Rendered(text, [(start, len(text), "content")], add_special_tokens=True, append_eos=True)


def instruction_prompt(record: dict) -> tuple[str, str]:
    """(prompt for a chat user turn, prompt in the Alpaca layout) for an instruction record."""
    instruction, extra = record["instruction"], record.get("input") or ""
    chat_prompt = f"{instruction}\n\n{extra}" if extra else instruction
    layout = ALPACA_WITH_INPUT if extra else ALPACA
    return chat_prompt, layout.format(instruction=instruction, input=extra)


def render_text(text: str) -> Rendered:
    return Rendered(text, [(0, len(text), "content")], add_special_tokens=True, append_eos=True)


def render_prompt_only(tokenizer, prompt: str | list[dict], opts: RenderOptions,
                       tools: list[dict] | None = None) -> Rendered:
    """An RL prompt, ending where the model's answer begins."""
    if opts.chat or isinstance(prompt, list):
        system = [{"role": "system", "content": opts.system_prompt}] if opts.system_prompt else []
        messages = system + as_messages(prompt, "user")
        if opts.tool_format in BUILTIN_TOOL_FORMATS:
            messages, _, _ = to_builtin_format(opts.tool_format, messages, [False] * len(messages), tools)
            tools = None
        return Rendered(render_chat(tokenizer, messages, add_generation_prompt=True, tools=tools))
    return Rendered(prompt, add_special_tokens=True)


def render_steps(prompt: str, steps: list[str]) -> Rendered:
    """PRM: prompt and steps joined by newlines; each step is labelled at its last character."""
    text, anchors = prompt, []
    for step in steps:
        text += PRM_STEP_SEPARATOR + step
        anchors.append(len(text) - 1)
    return Rendered(text, add_special_tokens=True, anchors=anchors)
