"""Ollama: the GGUF beside a Modelfile whose TEMPLATE, SYSTEM and stop tokens come from the chat
template the model was trained with (chat_layout.py reads its layout off renderings).

The TEMPLATE is a Go template over Ollama's `.System` and `.Messages`, with no whitespace
trimming, so every character between the actions is the template's own text:

    head, then the system block when there is system text (or always, where the template always
    writes one), then each user turn (the system text inside the first one, for templates that fold
    it there) and each assistant turn, then the generation prompt after a final user turn. A final
    assistant turn is left open, so Ollama continues it.

SYSTEM is the default system prompt the template writes when a conversation has none (Ollama adds
it as a system message then). Stop tokens: the special tokens that close an assistant turn or open a
user turn, and EOS. Sampling PARAMETERs are copied from generation_config.json where it asks for
sampling (do_sample: true); otherwise Ollama's defaults apply.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import MudpuppyError
from .chat_layout import TurnLayout, turn_tokens

# generation_config.json key -> Modelfile PARAMETER
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p"}


def go_literal(text: str) -> str:
    """Text a Go template writes as is; "{{" alone would open an action."""
    return text.replace("{{", '{{ "{{" }}')


def go_template(layout: TurnLayout) -> str:
    lit = go_literal
    out = [lit(layout.head)]
    system_block = lit(layout.system[0]) + "{{ .System }}" + lit(layout.system[1])
    if layout.system_folded:
        out.append("{{ $system := .System }}")
    elif layout.system_always:
        out.append(system_block)
    else:
        out.append("{{ if .System }}" + system_block + "{{ end }}")
    out.append("{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}")
    user = '{{ if eq .Role "user" }}' + lit(layout.user[0])
    if layout.system_folded:
        user += ("{{ if $system }}" + lit(layout.system[0]) + "{{ $system }}" + lit(layout.system[1])
                 + '{{ $system = "" }}{{ end }}')
    user += "{{ .Content }}" + lit(layout.user[1]) + "{{ if $last }}" + lit(layout.generation) + "{{ end }}"
    assistant = ('{{ else if eq .Role "assistant" }}' + lit(layout.assistant[0]) + "{{ .Content }}"
                 + "{{ if not $last }}" + lit(layout.assistant[1]) + "{{ end }}")
    out += [user, assistant, "{{ end }}{{ end }}"]
    return "".join(out)


def stop_words(tokenizer, layout: TurnLayout) -> list[str]:
    end_of_turn, turn_start = turn_tokens(tokenizer, layout)
    words = end_of_turn + turn_start + ([tokenizer.eos_token] if tokenizer.eos_token else [])
    return list(dict.fromkeys(w for w in words if w))


def sampling_parameters(model_dir: Path) -> dict[str, float | int]:
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    gen = json.loads(path.read_text(encoding="utf-8"))
    params: dict[str, float | int] = {}
    if gen.get("do_sample"):
        params.update({ours: gen[key] for key, ours in SAMPLING.items() if gen.get(key) is not None})
    if gen.get("repetition_penalty") not in (None, 1.0):
        params["repeat_penalty"] = gen["repetition_penalty"]
    return params


def _quoted(text: str, what: str) -> str:
    if '"""' in text:
        raise MudpuppyError(f'the {what} contains """, which a Modelfile cannot quote')
    return f'"""{text}"""'


def modelfile(gguf_name: str, tokenizer, layout: TurnLayout, params: dict, source: str) -> str:
    lines = [f"# Written by mudpuppy export from {source}.",
             "# Create and run it with:  ollama create NAME -f Modelfile  &&  ollama run NAME",
             f"FROM ./{gguf_name}",
             f"TEMPLATE {_quoted(go_template(layout), 'chat template')}"]
    if layout.default_system:
        lines.append(f"SYSTEM {_quoted(layout.default_system, 'default system prompt')}")
    for word in stop_words(tokenizer, layout):
        lines.append(f"PARAMETER stop {json.dumps(word)}")
    for key, value in params.items():
        lines.append(f"PARAMETER {key} {value}")
    return "\n".join(lines) + "\n"
