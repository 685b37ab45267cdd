"""A chat template's turn layout, learnt by rendering it, so other runtimes can reproduce it.

Ollama takes a Go template, not Jinja. Rather than translating Jinja, the template
the model was trained with is rendered on a few conversations whose contents are
sentinels, and the literal text around each message is read off:

    head + [system block] + (before_role + content + after_role)... + generation prompt

with the system text either in a turn of its own (chatml, llama3, phi3, zephyr) or
folded into the first user turn (mistral, llama2, gemma), and a default system
prompt where the template adds one when the conversation has none (SmolLM2's).
The layout is then checked: it must render every probe conversation exactly as
the Jinja template does, or the template is reported as not reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..data.render import render_chat
from ..errors import MudpuppyError

# Plain words: no template trims, escapes or splits them.
SYSTEM, USER1, REPLY1, USER2, REPLY2, USER3 = ("qqSystemTextqq", "qqFirstQuestionqq", "qqFirstAnswerqq",
                                               "qqSecondQuestionqq", "qqSecondAnswerqq", "qqThirdQuestionqq")


class LayoutError(MudpuppyError):
    """A chat template whose turns are not plain text around each message."""


@dataclass(frozen=True)
class TurnLayout:
    head: str                      # written once, before everything (usually the BOS the template writes)
    system: tuple[str, str]        # around the system text
    user: tuple[str, str]
    assistant: tuple[str, str]
    generation: str                # the generation prompt after the last user turn
    system_folded: bool = False    # the system text sits inside the first user turn, after user[0]
    default_system: str | None = None   # written when the conversation has no system message
    system_always: bool = False    # a system block is written even when the system text is empty

    def render(self, messages: list[dict]) -> str:
        """The prompt for the next assistant turn, as the Ollama template renders it: system messages
        joined into one system text (the default when there are none), the other turns in order, an
        unfinished last assistant turn left open."""
        systems = [m["content"] for m in messages if m["role"] == "system"]
        system = "\n\n".join(systems) if systems else (self.default_system or "")
        turns = [m for m in messages if m["role"] in ("user", "assistant")]
        out = self.head
        if not self.system_folded and (system or self.system_always):
            out += self.system[0] + system + self.system[1]
        pending = system if self.system_folded else ""
        for i, m in enumerate(turns):
            last = i == len(turns) - 1
            if m["role"] == "user":
                out += self.user[0]
                if pending:
                    out += self.system[0] + pending + self.system[1]
                    pending = ""
                out += m["content"] + self.user[1] + (self.generation if last else "")
            else:
                out += self.assistant[0] + m["content"] + ("" if last else self.assistant[1])
        return out


def conversation(*pairs: tuple[str, str]) -> list[dict]:
    return [{"role": r, "content": c} for r, c in pairs]


PROBES = [
    conversation(("user", USER1)),
    conversation(("system", SYSTEM), ("user", USER1)),
    conversation(("user", USER1), ("assistant", REPLY1), ("user", USER2)),
    conversation(("system", SYSTEM), ("user", USER1), ("assistant", REPLY1), ("user", USER2),
                 ("assistant", REPLY2), ("user", USER3)),
    conversation(("system", "two\nlines"), ("user", "a question\nover two lines"), ("assistant", "an answer"),
                 ("user", "and {{ braces }} too")),
]


def infer_layout(tokenizer, where: str) -> TurnLayout:
    """The layout of the chat template installed on `tokenizer`; LayoutError when none reproduces it."""
    if not getattr(tokenizer, "chat_template", None):
        raise LayoutError(f"{where}: the tokenizer has no chat template, so there is no conversation layout to "
                          "write; pass --chat-template (a built-in name or Jinja) or export a run that used one")
    render = _renderer(tokenizer, where)
    bos = tokenizer.bos_token or ""
    heads = [""] + ([bos] if bos else [])
    for head in heads:
        for folded in (False, True):
            layout = _propose(render, head, folded)
            if layout is not None and all(layout.render(p) == render(p, True) for p in PROBES):
                return layout
    raise LayoutError(f"{where}: the chat template is not a plain turn-by-turn layout (it rewrites or reorders "
                      "messages, or depends on more than their role and text), so it cannot be written as an "
                      "Ollama template; export --format gguf (which embeds the Jinja template itself), or train "
                      "with a built-in template (data.chat_template: chatml, llama3, mistral, ...)")


def _renderer(tokenizer, where: str):
    def render(messages: list[dict], generation: bool) -> str:
        try:
            return render_chat(tokenizer, messages, add_generation_prompt=generation)
        except Exception as exc:    # jinja raises its own errors (raise_exception in the template, ...)
            raise LayoutError(f"{where}: the chat template failed on a plain conversation "
                              f"({type(exc).__name__}: {exc})") from exc
    return render


def _propose(render, head: str, folded: bool) -> TurnLayout | None:
    """Read the literal text around each message off sentinel renderings; None when the pieces do
    not fit together this way (another head or system placement may)."""
    plain = [("user", USER1), ("assistant", REPLY1), ("user", USER2)]
    with_gen = render(conversation(*plain), True)
    without = render(conversation(*plain), False)
    answered = render(conversation(*plain[:2]), False)
    if not with_gen.startswith(without):
        return None
    generation = with_gen[len(without):]
    at = _positions(with_gen, USER1, REPLY1, USER2)
    if at is None or REPLY1 not in answered:
        return None
    u1, r1, u2 = at
    after_assistant = answered[answered.index(REPLY1) + len(REPLY1):]
    between_u1_r1 = with_gen[u1 + len(USER1):r1]
    between_r1_u2 = with_gen[r1 + len(REPLY1):u2]
    tail = with_gen[u2 + len(USER2):]
    if not tail.endswith(generation) or not between_r1_u2.startswith(after_assistant):
        return None
    after_user = tail[:len(tail) - len(generation)]
    before_user = between_r1_u2[len(after_assistant):]
    if not between_u1_r1.startswith(after_user) or not with_gen[:u1].endswith(before_user):
        return None
    before_assistant = between_u1_r1[len(after_user):]
    preamble = with_gen[:u1 - len(before_user)]           # head + the default system block, if any
    if not preamble.startswith(head):
        return None
    default_block = preamble[len(head):]

    systemed = render(conversation(("system", SYSTEM), *plain), True)
    if SYSTEM not in systemed or USER1 not in systemed:
        return None
    s, u = systemed.index(SYSTEM), systemed.index(USER1)
    if s > u or systemed[u:] != with_gen[u1:]:
        return None
    before_system, after_system = systemed[:s], systemed[s + len(SYSTEM):u]
    turns = dict(user=(before_user, after_user), assistant=(before_assistant, after_assistant),
                 generation=generation, head=head)
    if folded:
        if default_block or not before_system.startswith(head + before_user):
            return None
        return TurnLayout(system=(before_system[len(head) + len(before_user):], after_system), system_folded=True,
                          **turns)
    if not before_system.startswith(head) or not after_system.endswith(before_user):
        return None
    system = (before_system[len(head):], after_system[:len(after_system) - len(before_user)])
    if not default_block:
        return TurnLayout(system=system, **turns)
    if not (default_block.startswith(system[0]) and default_block.endswith(system[1])
            and len(default_block) >= len(system[0]) + len(system[1])):
        return None
    default = default_block[len(system[0]):len(default_block) - len(system[1])]
    return TurnLayout(system=system, default_system=default or None, system_always=not default, **turns)


def _positions(text: str, *needles: str) -> list[int] | None:
    at, start = [], 0
    for needle in needles:
        if text.count(needle) != 1:
            return None
        i = text.find(needle, start)
        if i < 0:
            return None
        at.append(i)
        start = i + len(needle)
    return at


def turn_tokens(tokenizer, layout: TurnLayout) -> tuple[list[str], list[str]]:
    """(end-of-turn tokens: the special tokens that close an assistant turn, in order;
    turn-start tokens: those that open a user turn). Both are where generation must stop."""
    specials = sorted(tokenizer.added_tokens_encoder, key=len, reverse=True)

    def found(text: str) -> list[str]:
        hits = sorted({(text.find(t), t) for t in specials if t and t in text})
        return [t for _, t in hits]

    return found(layout.assistant[1]), found(layout.user[0])
