"""The Modelfile's TEMPLATE, rendered by a small Go-template interpreter written here, must give the
prompt the Jinja chat template gives, for each template family and the run's own."""

from __future__ import annotations

import copy
import re

import pytest

from mudpuppy.data.templates import BUILTIN_TEMPLATES
from mudpuppy.export import ExportRequest, export_model
from mudpuppy.export.chat_layout import LayoutError, infer_layout
from mudpuppy.export.ollama import go_template, stop_words

from .conftest import RUN_TEMPLATE

# SmolLM2-135M-Instruct's own template: a default system prompt when the conversation has none.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# --------------------------------------------------------------------------- a Go template interpreter
# Enough of text/template for what the exporter writes: text, {{ if }} / {{ else if }} / {{ else }} /
# {{ end }}, {{ range $i, $_ := X }}, variables declared (:=) and assigned (=), fields of the dot and of
# $, string and number literals, and the functions eq, not, len, slice. No whitespace trimming.

TOKEN = re.compile(r'\s*(\(|\)|"(?:[^"\\]|\\.)*"|[^\s()]+)')


def parse_expr(tokens: list[str]):
    def term():
        tok = tokens.pop(0)
        if tok == "(":
            node = call()
            assert tokens.pop(0) == ")"
            return node
        return ("atom", tok)

    def call():
        items = [term()]
        while tokens and tokens[0] != ")":
            items.append(term())
        return items[0] if len(items) == 1 else ("call", items)

    node = call()
    assert not tokens, tokens
    return node


def evaluate(node, dot, root, env):
    if node[0] == "call":
        fn, *args = node[1]
        values = [evaluate(a, dot, root, env) for a in args]
        name = fn[1]
        if name == "eq":
            return values[0] == values[1]
        if name == "not":
            return not values[0]
        if name == "len":
            return len(values[0])
        if name == "slice":
            return values[0][values[1]:]
        raise AssertionError(f"function {name}")
    tok = node[1]
    if tok.startswith('"'):
        return bytes(tok[1:-1], "utf-8").decode("unicode_escape")
    if tok.isdigit():
        return int(tok)
    if tok.startswith("$."):
        return root[tok[2:]]
    if tok.startswith("$"):
        return env[tok]
    if tok.startswith("."):
        return dot[tok[1:]]
    raise AssertionError(f"atom {tok}")


def parse_template(text: str):
    """[(kind, ...)] nodes: ("text", s), ("out", expr), ("set", var, expr, declare), ("if", [(cond, body)], else),
    ("range", ivar, vvar, expr, body)."""
    pieces = re.split(r"(\{\{.*?\}\})", text, flags=re.S)
    stream = [("text", p) if not p.startswith("{{") else ("action", p[2:-2].strip()) for p in pieces if p]
    assert all(not (a == "action" and (b.startswith("-") or b.endswith("-"))) for a, b in stream), "no trimming"

    def block(until):
        nodes = []
        while stream:
            kind, body = stream.pop(0)
            if kind == "text":
                nodes.append(("text", body))
                continue
            head = body.split()[0]
            if head in until:
                return nodes, body
            if head == "if":
                branches, rest = [], body[2:]
                while True:
                    inner, closer = block(("else", "end"))
                    branches.append((parse_expr(TOKEN.findall(rest)), inner))
                    if closer == "end":
                        nodes.append(("if", branches, []))
                        break
                    if closer.startswith("else if"):
                        rest = closer[len("else if"):]
                        continue
                    other, _ = block(("end",))
                    nodes.append(("if", branches, other))
                    break
            elif head == "range":
                m = re.match(r"range (\$\w+), (\$\w+) := (.*)", body)
                inner, _ = block(("end",))
                nodes.append(("range", m[1], m[2], parse_expr(TOKEN.findall(m[3])), inner))
            elif re.match(r"\$\w+ :?= ", body):
                var, op, expr = re.match(r"(\$\w+) (:?=) (.*)", body, flags=re.S).groups()
                nodes.append(("set", var, parse_expr(TOKEN.findall(expr)), op == ":="))
            else:
                nodes.append(("out", parse_expr(TOKEN.findall(body))))
        return nodes, None

    nodes, rest = block(())
    assert rest is None
    return nodes


def execute(nodes, dot, root, env) -> str:
    out = []
    for node in nodes:
        kind = node[0]
        if kind == "text":
            out.append(node[1])
        elif kind == "out":
            out.append(str(evaluate(node[1], dot, root, env)))
        elif kind == "set":
            _, var, expr, declare = node
            assert declare or var in env, f"{var} assigned before it is declared"
            env[var] = evaluate(expr, dot, root, env)
        elif kind == "if":
            for cond, body in node[1]:
                if evaluate(cond, dot, root, env):
                    out.append(execute(body, dot, root, env))
                    break
            else:
                out.append(execute(node[2], dot, root, env))
        elif kind == "range":
            _, ivar, vvar, expr, body = node
            for i, item in enumerate(evaluate(expr, dot, root, env)):
                inner = dict(env, **{ivar: i, vvar: item})
                out.append(execute(body, item, root, inner))
                env.update({k: v for k, v in inner.items() if k in env})   # assignments outlive the loop
    return "".join(out)


def ollama_prompt(template: str, messages: list[dict], default_system: str | None) -> str:
    """What Ollama renders: the Modelfile's SYSTEM added as a system message when there is none,
    consecutive messages of one role merged, .System all system texts joined."""
    if default_system and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": default_system}] + messages
    collated: list[dict] = []
    for m in messages:
        if collated and collated[-1]["Role"] == m["role"]:
            collated[-1]["Content"] += "\n\n" + m["content"]
        else:
            collated.append({"Role": m["role"], "Content": m["content"]})
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    root = {"System": system, "Messages": collated}
    return execute(parse_template(template), root, root, {})


def test_the_interpreter_reads_go_templates_as_go_does():
    template = ('{{ $x := .System }}{{ range $i, $_ := .Messages }}{{ if eq .Role "user" }}[{{ .Content }}]'
                '{{ if $x }}<{{ $x }}>{{ $x = "" }}{{ end }}{{ else if eq .Role "a" }}({{ .Content }}){{ else }}?'
                '{{ end }}{{ if eq (len (slice $.Messages $i)) 1 }}!{{ end }}{{ end }}{{ "{{" }}')
    root = {"System": "s", "Messages": [{"Role": "user", "Content": "u1"}, {"Role": "a", "Content": "a1"},
                                        {"Role": "x", "Content": ""}, {"Role": "user", "Content": "u2"}]}
    assert execute(parse_template(template), root, root, {}) == "[u1]<s>(a1)?[u2]!{{"


# --------------------------------------------------------------------------- the templates

CONVERSATIONS = [
    [{"role": "user", "content": "turn on the lights"}],
    [{"role": "system", "content": "Answer with the intent label."}, {"role": "user", "content": "lock the door"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"},
     {"role": "user", "content": "what is\nthe weather?"}],
    [{"role": "system", "content": "Be brief.\nVery brief."}, {"role": "user", "content": "one"},
     {"role": "assistant", "content": "two"}, {"role": "user", "content": "three {{ x }}"},
     {"role": "assistant", "content": "four"}, {"role": "user", "content": "five"}],
]

TEMPLATES = {**{name: t.jinja for name, t in BUILTIN_TEMPLATES.items()}, "smollm2": SMOLLM2}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_go_template_renders_conversations_as_the_jinja_template(tokenizer, name):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATES[name]
    layout = infer_layout(tok, name)
    template = go_template(layout)
    for messages in CONVERSATIONS:
        jinja = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ollama_prompt(template, messages, layout.default_system) == jinja, messages
    if name == "smollm2":
        assert layout.default_system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    if name in ("chatml", "smollm2"):
        assert stop_words(tok, layout) == ["<|im_end|>", "<|im_start|>"]


def test_a_template_that_is_not_turn_by_turn_is_refused(tokenizer):
    tok = copy.deepcopy(tokenizer)
    # the system prompt written after the conversation: no plain layout renders this
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'system' %}{{ m['role'] + ': ' + m['content'] "
                         "+ '\n' }}{% endif %}{% endfor %}{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ '(' + m['content'] + ')' }}{% endif %}{% endfor %}")
    with pytest.raises(LayoutError, match="not a plain turn-by-turn layout"):
        infer_layout(tok, "odd")
    tok.chat_template = None
    with pytest.raises(LayoutError, match="--chat-template"):
        infer_layout(tok, "none")


def test_an_ollama_export_of_a_run_uses_its_training_template(lora_run, tmp_path, tokenizer):
    from transformers import AutoTokenizer

    out = tmp_path / "ollama"
    export_model(ExportRequest(str(lora_run), "ollama", str(out), quant="q8_0"), echo=lambda *_a, **_k: None)
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "README.md", "export.json", "model-q8_0.gguf"]
    assert f"ollama create {out.name} -f Modelfile" in (out / "README.md").read_text()
    text = (out / "Modelfile").read_text()
    assert "FROM ./model-q8_0.gguf" in text
    template = re.search(r'TEMPLATE """(.*?)"""', text, flags=re.S)[1]
    trained = AutoTokenizer.from_pretrained(str(lora_run))
    assert trained.chat_template == BUILTIN_TEMPLATES[RUN_TEMPLATE].jinja
    for messages in CONVERSATIONS:
        jinja = trained.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ollama_prompt(template, messages, None) == jinja
    # zephyr ends a turn with EOS (<|im_end|> here) and opens one with <|user|>, not a token here
    assert re.findall(r'PARAMETER stop "(.*)"', text) == ["<|im_end|>"]
    assert "SYSTEM" not in text
