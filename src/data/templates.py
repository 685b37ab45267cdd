"""Chat templates: the tokenizer's own, a built-in one by name, or the user's Jinja.

Built-ins exist for tokenizers that ship no template (base models) and for
users who want a specific layout. Each is written so that rendering a
conversation's first k messages is a prefix of rendering all of them: loss
masks are derived from that property (see `render.py`). The templates that
model families publish sometimes break it (a trailing EOS only when no
generation prompt is asked for); these versions do not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import DataError


@dataclass(frozen=True)
class BuiltinTemplate:
    jinja: str
    markers: tuple[str, ...]     # strings a matching tokenizer has as single tokens


_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_LLAMA3 = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Llama 2 and Mistral fold the system prompt into the first user turn; the
# assistant turn has no header, so the generation prompt is empty.
_LLAMA2 = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ (bos_token or '') + '[INST] ' + ('<<SYS>>\n' + system + '\n<</SYS>>\n\n' if loop.first and system else '')"
    " + message['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] | trim + ' ' + (eos_token or '') }}{% endif %}"
    "{% endfor %}"
)

_MISTRAL = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{{ bos_token or '' }}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ message['content'] | trim + (eos_token or '') }}{% endif %}"
    "{% endfor %}"
)

_GEMMA = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] | trim + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{{ bos_token or '' }}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

_PHI3 = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_ZEPHYR = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + (eos_token or '') + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

BUILTIN_TEMPLATES: dict[str, BuiltinTemplate] = {
    "chatml": BuiltinTemplate(_CHATML, ("<|im_start|>", "<|im_end|>")),
    "llama3": BuiltinTemplate(_LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    "llama2": BuiltinTemplate(_LLAMA2, ()),
    "mistral": BuiltinTemplate(_MISTRAL, ()),
    "gemma": BuiltinTemplate(_GEMMA, ("<start_of_turn>", "<end_of_turn>")),
    "phi3": BuiltinTemplate(_PHI3, ("<|user|>", "<|assistant|>", "<|end|>")),
    "zephyr": BuiltinTemplate(_ZEPHYR, ()),
}

_JINJA = re.compile(r"\{\{|\{%")


def is_jinja(text: str) -> bool:
    return bool(_JINJA.search(text))


def resolve_chat_template(tokenizer, choice: str | None) -> str | None:
    """The Jinja source to render with: a built-in, the user's own, or the tokenizer's (may be None)."""
    if choice in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[choice].jinja
    if choice and choice != "tokenizer":
        return choice
    return getattr(tokenizer, "chat_template", None) or None


def apply_chat_template_choice(tokenizer, choice: str | None) -> str | None:
    """Install the chosen template on the tokenizer, so that evaluation, generation and the
    tokenizer saved beside the adapter all use the layout the model was trained on."""
    template = resolve_chat_template(tokenizer, choice)
    if template is not None and template != getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return template


def require_chat_template(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        names = ", ".join(BUILTIN_TEMPLATES)
        raise DataError(
            where, None,
            "chat data needs a chat template, and this tokenizer has none; set data.chat_template "
            f"to a built-in template ({names}) or your own Jinja, or use a tokenizer that ships one",
        )


def template_warnings(tokenizer, choice: str | None) -> list[str]:
    """Markers of a built-in template that this tokenizer would split into pieces.

    Training still works, but each marker costs several tokens and the model
    must learn them from scratch: usually a sign the template does not match
    the model.
    """
    builtin = BUILTIN_TEMPLATES.get(choice or "")
    if builtin is None:
        return []
    vocab = tokenizer.get_vocab()
    missing = [m for m in builtin.markers if m not in vocab]
    if not missing:
        return []
    return [f"chat template {choice!r}: this tokenizer has no single token for {', '.join(missing)}; "
            "they will be split into pieces (pick the template the model was trained with)"]
