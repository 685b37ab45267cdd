"""One conversation's prefixes through the chat template, each rendered once and cheaply.

Loss masks come from rendering a conversation several times (the whole, and
the prefixes and probes around each trained turn: see `render.py`). Through
transformers' `apply_chat_template` each of those calls spends as long
preparing the messages (dropping None keys, rebuilding every value from plain
JSON types, aliasing reasoning fields, reading the special tokens, looking the
compiled template up) as Jinja spends rendering. For messages that are
already plain JSON types with no None key and no reasoning field (what a
JSON, CSV or Parquet record gives), that preparation returns its input
unchanged, so `ConversationRenderer` checks that once per conversation and
then calls the same compiled template with the same arguments: the same text,
character for character (tests compare it with `apply_chat_template` on
every template in the test data). Anything else (other tokenizer classes,
the vision wrapper, unusual values) goes through `apply_chat_template`.
"""

from __future__ import annotations

from collections.abc import Callable


def template_message(m: dict) -> dict:
    """What a chat template sees of a message: role and content, and the tool parts when present
    (templates test ``'tool_calls' in message``, so the key is left out when there are none)."""
    out = {"role": m["role"], "content": m["content"]}
    for key in ("tool_calls", "name", "tool_call_id", "parts"):   # parts: images, for vision.VisionTokenizer
        if m.get(key):
            out[key] = m[key]
    return out


def apply_template(tokenizer, clean: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str:
    return tokenizer.apply_chat_template(clean, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


class ConversationRenderer:
    """Renders prefixes of one conversation (`prefix`) and a prefix plus one other message (`probe`).

    A prefix is rendered at most once per (length, generation prompt): the last trained turn's
    "rendered up to here" is the whole conversation, which is rendered anyway."""

    def __init__(self, tokenizer, messages: list[dict], tools: list[dict] | None = None):
        self.tokenizer, self.tools = tokenizer, tools or None
        self.clean = [template_message(m) for m in messages]
        self._direct = direct_renderer(tokenizer, self.clean, self.tools)
        self._memo: dict[tuple[int, bool], str] = {}
        # Turn frames learnt from earlier conversations through the same template (see `frame_key`).
        self.frames: dict | None = getattr(self._direct, "frames", None) if self.tools is None else None

    def prefix(self, n: int, add_generation_prompt: bool = False) -> str:
        """The first `n` messages rendered."""
        key = (n, add_generation_prompt)
        if key not in self._memo:
            self._memo[key] = self.render(self.clean[:n], add_generation_prompt)
        return self._memo[key]

    def probe(self, n: int, message: dict) -> str:
        """The first `n` messages and then `message` (say, a turn with a sentinel for its content)."""
        extra = template_message(message)
        return self.render(self.clean[:n] + [extra], False, plain=is_plain(extra))

    def frame_key(self, i: int) -> tuple | None:
        """What a probe of turn i shows the template, less the turn's content and the earlier turns'
        text: the roles and keys of messages 0..i and turn i's other values. Conversations alike in
        these usually share turn i's frame; a caller checks a remembered one against the rendered
        turn (the content verbatim between its two halves) before using it. None: nothing to remember."""
        if self.frames is None:
            return None
        own = tuple((k, v) for k, v in self.clean[i].items() if k != "content")
        if not all(type(v) is str for _, v in own):
            return None
        return tuple((m["role"], tuple(m)) for m in self.clean[:i]) + own

    def render(self, clean: list[dict], add_generation_prompt: bool, plain: bool = True) -> str:
        # An empty conversation goes to apply_chat_template, which refuses it in its own words.
        if self._direct is not None and clean and plain:
            return self._direct(clean, add_generation_prompt)
        return apply_template(self.tokenizer, clean, add_generation_prompt, self.tools)


def direct_renderer(tokenizer, clean: list[dict], tools: list[dict] | None) -> Callable | None:
    """(messages, add_generation_prompt) -> what `apply_chat_template(tokenize=False)` returns for
    these messages' prefixes and these tools; None where that cannot be promised."""
    ctu = _template_utils(type(tokenizer))
    if ctu is None:
        return None
    reasoning = getattr(ctu, "_REASONING_FIELDS", ("reasoning_content", "thinking", "reasoning"))
    if not is_plain(clean) or not is_plain(tools) or any(v is None or k in reasoning
                                                         for m in clean for k, v in m.items()):
        return None
    if tools is not None and not all(type(t) is dict for t in tools):
        return None
    try:
        template = tokenizer.get_chat_template(None, tools)
    except (ValueError, TypeError):      # no template, or several and none named: apply_chat_template says so
        return None
    if type(template) is not str:
        return None
    compiled, flat, kwargs, frames = _prepared(ctu, template, tokenizer.special_tokens_map)

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        # What Template.render does, less the copy of Jinja's globals (a ChainMap) into every call's context.
        names = {**flat, "messages": messages, "tools": tools, "documents": None,
                 "add_generation_prompt": add_generation_prompt, **kwargs}
        try:
            return "".join(compiled.root_render_func(compiled.new_context(names, shared=True)))
        except Exception:       # noqa: BLE001 - render again the usual way: the same error, raised as Jinja raises it
            return compiled.render(messages=messages, tools=tools, documents=None,
                                   add_generation_prompt=add_generation_prompt, **kwargs)
    render.frames = frames
    return render


_PREPARED: dict[str, tuple] = {}   # template source -> (compiled, special tokens map, globals, plain kwargs, frames)
FRAMES_KEPT = 256                   # turn frames remembered per template (conversation shapes seen)


def _prepared(ctu, template: str, special: dict) -> tuple:
    """(compiled template, its Jinja globals as one dict, the special tokens as the template sees them,
    the turn frames learnt through it), kept from the last conversation: looking them up costs more
    than checking they are still the same."""
    hit = _PREPARED.get(template)
    if hit is None or hit[1] != special:
        if len(_PREPARED) > 16:
            _PREPARED.clear()
        compiled = ctu._compile_jinja_template(template)
        hit = _PREPARED[template] = (compiled, dict(special), dict(compiled.globals),
                                     ctu._plain_template_data(dict(special)), {})
    return hit[0], hit[2], hit[3], hit[4]


_CLASSES: dict[type, object] = {}   # tokenizer class -> transformers' chat template module, or None: no shortcut


def _template_utils(cls):
    """transformers' chat template helpers where tokenizers of class `cls` render through them unchanged,
    else None; looked up once per class (a conversation's renderer is built for every record)."""
    if cls not in _CLASSES:
        try:
            from transformers import PreTrainedTokenizerBase as base
            from transformers.utils import chat_template_utils as ctu
        except ImportError:
            ctu = base = None
        usable = base is not None and issubclass(cls, base) and _unchanged(cls, base) \
            and hasattr(ctu, "_compile_jinja_template") and hasattr(ctu, "_plain_template_data")
        _CLASSES[cls] = ctu if usable else None
    return _CLASSES[cls]


def _unchanged(cls, base) -> bool:
    """The tokenizer class renders as the base class does (a subclass could prepare messages its own way)."""
    return all(getattr(cls, name) is getattr(base, name) for name in ("apply_chat_template", "get_chat_template"))


def is_plain(value) -> bool:
    """Built of exactly dict (str keys), list, str, int, float, bool and None: what transformers'
    `_plain_template_data` returns unchanged."""
    kind = type(value)
    if value is None or kind in (str, int, float, bool):
        return True
    if kind is dict:      # str values (nearly all of a chat's) checked here, without a call each
        return all(type(k) is str and (type(v) is str or is_plain(v)) for k, v in value.items())
    if kind is list:
        return all(type(v) is str or is_plain(v) for v in value)
    return False
