"""GRPO with tools and environments: reading calls, running them, the multi-turn loop, masking, runs.

The loop's bookkeeping (which tokens are the model's, the budget, what is rolled
back) is checked against TRL 1.16's own `_tool_call_loop` and
`_get_tool_suffix_ids`, run on a stand-in trainer with the same tokenizer,
template, tools and scripted turns. That the tool tokens carry no loss and no
log-prob is checked against the model's own forward. A run end to end uses a
scripted sampler (the tiny model's random weights never write a call).
"""

from __future__ import annotations

import json
import shutil
import time
import types

import numpy as np
import pytest
import torch
import yaml

from mudpuppy import create_backend, load_config, run
from mudpuppy.config import ModelConfig
from mudpuppy.data import IGNORE_INDEX
from mudpuppy.errors import ConfigError, MudpuppyError
from mudpuppy.training.environments import Environments
from mudpuppy.training.multiturn import ToolLoop
from mudpuppy.training.rollout import completion_batch
from mudpuppy.training.tools import Call, Tool, ToolError, load_tools, parse_turn, run_call, schema_of

from .test_grpo import grpo_config

# ChatML that renders tool calls as Hermes tags and tool results in a `tool` turn (as Qwen2.5 does).
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def multiply(a: int, b: int) -> int:
    """Multiply two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a * b


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("the service is down")


def slow(x: int) -> int:
    """Takes too long.

    Args:
        x: anything
    """
    time.sleep(5)
    return x


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture()
def tool_tokenizer(tokenizer):
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.chat_template = TOOL_TEMPLATE
    return tok


def tool(fn) -> Tool:
    return Tool(fn.__name__, fn, schema_of(fn, fn.__name__), fn.__name__)


# --------------------------------------------------------------------------- reading calls

def test_hermes_and_llama3_calls_are_read_back():
    turn = parse_turn('Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n'
                      '</tool_call>\n<tool_call>{"name": "multiply", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}'
                      '</tool_call>', "hermes")
    assert turn.content == "Let me compute."
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [("multiply", {"a": 3, "b": 4}, None),
                                                                     ("multiply", {"a": 1, "b": 2}, None)]
    assert turn.message()["tool_calls"][0] == {"type": "function",
                                               "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    assert parse_turn("12", "hermes").calls == [] and parse_turn("12", "hermes").message() == {
        "role": "assistant", "content": "12"}
    bad = parse_turn("<tool_call>{name: multiply}</tool_call>", "hermes").calls
    assert len(bad) == 1 and "not valid JSON" in bad[0].error
    # An unterminated last call (the turn stopped at end-of-turn) is still read.
    assert parse_turn('<tool_call>{"name": "f", "arguments": {}}', "hermes").calls[0].name == "f"
    llama = parse_turn('{"name": "multiply", "parameters": {"a": 2, "b": 5}}', "llama3")
    assert (llama.content, llama.calls[0].name, llama.calls[0].arguments) == ("", "multiply", {"a": 2, "b": 5})
    assert parse_turn("The answer is 10.", "llama3").calls == []


def test_calls_run_as_trl_runs_them_and_never_raise():
    tools = {"multiply": multiply, "broken": broken, "slow": slow}
    assert run_call(Call("multiply", {"a": 6, "b": 7}), tools, 5) == ("42", False)
    assert run_call(Call("broken", {"x": 1}), tools, 5) == ("{'error': 'the service is down'}", True)
    assert run_call(Call("nope", {}), tools, 5) == ("{'error': 'Tool nope not found.'}", True)
    text, failed = run_call(Call("multiply", {"c": 1}), tools, 5)        # wrong arguments: a TypeError
    assert failed and "unexpected keyword argument" in text
    started = time.perf_counter()
    text, failed = run_call(Call("slow", {"x": 1}), tools, 0.2)
    assert failed and "did not answer within 0.2 s" in text and time.perf_counter() - started < 2
    assert run_call(Call("unknown", {}, "the tool call is not valid JSON"), tools, 5)[1]

    async def fetch(key: str) -> str:
        return key.upper()

    assert run_call(Call("fetch", {"key": "ab"}), {"fetch": fetch}, 5) == ("AB", False)


# --------------------------------------------------------------------------- bad tools and environments

def test_bad_tools_are_refused_before_the_model_loads_naming_file_and_function(tmp_path):
    (tmp_path / "t.py").write_text("def good(a: int) -> int:\n    '''Good.\n\n    Args:\n        a: a\n    '''\n"
                                   "    return a\n\ndef undocumented(a: int) -> int:\n    return a\n")
    (tmp_path / "crash.py").write_text("raise ImportError('no such backend')\n")
    with pytest.raises(ToolError) as err:
        load_tools(["t.py:undocumented", "crash.py:f", "t.py:missing", "t.py:good", "t.py:good"], str(tmp_path))
    text = str(err.value)
    assert "grpo.tools[0] (t.py:undocumented): a tool needs a docstring and type hints" in text
    assert "grpo.tools[1] crash.py:f: importing crash.py failed" in text and "no such backend" in text
    assert "grpo.tools[2] t.py:missing" in text and "has no function 'missing'" in text
    assert "two tools are called 'good'" in text
    assert [t.name for t in load_tools(["t.py:good"], str(tmp_path))] == ["good"]


def test_environment_factories_are_checked_when_loaded(tmp_path):
    (tmp_path / "env.py").write_text(
        "class Counter:\n"
        "    def __init__(self):\n        self.n = 0\n"
        "    def reset(self, **row):\n        self.n = 0\n        return None\n"
        "    def add(self, k: int) -> int:\n        '''Add k.\n\n        Args:\n            k: how much\n        '''\n"
        "        self.n += k\n        return self.n\n"
        "    def _private(self):\n        pass\n"
        "    def get_reward(self):\n        return float(self.n)\n"
        "def boom():\n    raise ValueError('no database')\n"
        "class NoReset:\n    pass\n")
    envs = Environments("env.py:Counter", str(tmp_path))
    assert envs.method_names == ["add"] and envs.has_reward
    a, b = envs.take(2)
    envs.tools_of(a)[0].fn(k=3)
    assert (a.n, b.n) == (3, 0)                      # each rollout's tools act on its own instance
    assert envs.reward_function()(environments=[a, b]) == [3.0, 0.0]
    with pytest.raises(ToolError, match=r"grpo.environment \(env.py:boom\): the factory raised at .*env.py:\d+: "
                                        r"ValueError: no database"):
        Environments("env.py:boom", str(tmp_path))
    with pytest.raises(ToolError, match="without a reset"):
        Environments("env.py:NoReset", str(tmp_path))


def test_config_refuses_malformed_tool_entries(tiny_config, tmp_path):
    cfg = grpo_config(tiny_config, tmp_path / "r", tools=["calculator"], environment="env.py")
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert "tools[0]: 'calculator' is not 'path/to/file.py:function'" in str(err.value)
    assert "environment: 'env.py' is not" in str(err.value)
    cfg = grpo_config(tiny_config, tmp_path / "r", reward_funcs=[])
    with pytest.raises(ConfigError, match="name one or more reward functions"):
        load_config(cfg)


# --------------------------------------------------------------------------- the loop, against TRL

def scripted(tokenizer, prompts: list[list[int]], script: list[list[str]]):
    """A sampler returning fixed text per rollout and round (what a model might have written); the
    rollout is known by its prompt, which is the start of what it is asked to continue."""

    def sample(inputs, max_new, round_):
        out = []
        for ids in inputs:
            i = next(k for k, p in enumerate(prompts) if ids[: len(p)] == p)
            out.append(tokenizer(script[i][round_], add_special_tokens=False)["input_ids"][:max_new])
        return out

    return sample


CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call><|im_end|>'


# The call is 77 tokens of this tokenizer, a result 20: 400 holds every turn, 200 rolls the second
# results back, 120 cuts the second call short, 60 the first.
@pytest.mark.parametrize("budget,iterations", [(400, None), (400, 1), (200, None), (120, None), (60, None)])
def test_the_loop_keeps_the_same_tokens_and_mask_as_trls(tool_tokenizer, budget, iterations):
    trl = pytest.importorskip("trl.trainer.grpo_trainer")
    tok = tool_tokenizer
    stop = {tok.convert_tokens_to_ids("<|im_end|>")}
    questions = [[{"role": "user", "content": f"question {i}"}] for i in range(3)]
    prompts = [tok.apply_chat_template(q, add_generation_prompt=True, tokenize=True, return_dict=False)
               for q in questions]
    # Rollout 0 calls twice then answers; rollout 1 answers at once; rollout 2 calls a tool that fails,
    # then answers.
    script = [[CALL, CALL, "408<|im_end|>"], ["408<|im_end|>"],
              [CALL.replace("multiply", "broken"), "sorry<|im_end|>"]]
    loop = ToolLoop(tok, "template", budget, 512, iterations, 5.0, stop)
    ours = loop.run(prompts, [[tool(multiply), tool(broken)]] * 3, scripted(tok, prompts, script))

    # TRL's loop on a stand-in trainer: same tokenizer and template, the same scripted turns. TRL reads
    # calls with the tokenizer's response schema, which this template has none of: ours stands in.
    def parse_response(tokenizer, ids, prefix=None, tools=None):
        return parse_turn(tokenizer.decode(ids, skip_special_tokens=True), "hermes").message()

    sample, rounds = scripted(tok, prompts, script), iter(range(1, 10))

    def generate_single_turn(ids, images, fields, num_generations=1, has_tool_images=False):
        return sample(ids, budget, next(rounds)), None

    first = sample(prompts, budget, 0)
    fake = types.SimpleNamespace(
        processing_class=tok, chat_template=None, chat_template_kwargs={}, _tokenizer=tok, _is_vlm=False,
        use_vllm=False, model=types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=512)),
        max_completion_length=budget, max_tool_calling_iterations=iterations or 10**9, environment_factories=None,
        tools=[multiply, broken], _sync_tool_dicts=[{"multiply": multiply, "broken": broken}] * 3,
        _async_tool_dicts=[{}] * 3, _generate_single_turn=generate_single_turn)
    fake._get_tool_suffix_ids = types.MethodType(trl.GRPOTrainer._get_tool_suffix_ids, fake)
    original = trl.parse_response
    trl.parse_response = parse_response
    try:
        mask, messages, ids, _, calls, failures, _ = trl.GRPOTrainer._tool_call_loop(
            fake, [list(q) for q in questions], prompts, [list(x) for x in first],
            [[parse_response(tok, x)] for x in first], None, None, None)
    finally:
        trl.parse_response = original
    assert [e.ids for e in ours] == ids
    assert [[int(s) for s in e.sampled] for e in ours] == mask
    assert sum(e.calls for e in ours) == calls and sum(e.failures for e in ours) == failures
    # 60 tokens leave no room for a tool's result: every rollout ends in its first call.
    assert any(0 in m for m in mask) == (budget > 60)
    # Reward functions see what TRL's see: the turns and the tool results, in order.
    for e, theirs in zip(ours, messages):
        assert [(m["role"], m.get("content"), m.get("name")) for m in e.messages] == \
               [(m["role"], m.get("content"), m.get("name")) for m in theirs]


def test_tool_results_carry_no_loss_and_the_sampled_tokens_keep_their_log_probs(tiny_model_dir, tokenizer):
    backend = create_backend("cpu")
    handle = backend.load_model(ModelConfig(base_model=str(tiny_model_dir)), "fp32")
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    loop = ToolLoop(tokenizer, "hermes", 200, 512, None, 5.0, stop)
    prompt = tokenizer("<|im_start|>user\n12 times 34?<|im_end|>\n<|im_start|>assistant\n",
                       add_special_tokens=False)["input_ids"]
    [ex] = loop.run([prompt], [[tool(multiply)]], scripted(tokenizer, [prompt], [[CALL, "408<|im_end|>"]]))
    sampled = np.asarray(ex.sampled)
    suffix = tokenizer.decode([t for t, s in zip(ex.ids, sampled) if not s])
    assert suffix == "\n<|im_start|>tool\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert ex.messages[1] == {"role": "tool", "name": "multiply", "content": "408"}
    batch = completion_batch([prompt], [ex.ids], [True], tokenizer.pad_token_id, [ex.sampled])
    rows = np.nonzero(batch.labels != IGNORE_INDEX)
    assert len(rows[0]) == sampled.sum()
    logps, _ = backend.token_logprobs(handle, batch, grad=False)
    with torch.no_grad():
        logits = handle.model(input_ids=torch.tensor(batch.input_ids)).logits.float()
    positions = len(prompt) - 1 + np.nonzero(sampled)[0]
    targets = np.asarray(ex.ids)[sampled]
    expected = torch.log_softmax(logits[0, positions], -1)[torch.arange(len(targets)), torch.tensor(targets)]
    np.testing.assert_allclose(backend.ops.to_numpy(logps), expected.numpy(), atol=1e-5)


# --------------------------------------------------------------------------- runs

ENV = '''
class Lookup:
    """Each rollout's table; the observation names the key to find."""
    made = 0

    def __init__(self):
        Lookup.made += 1
        self.table, self.looked = {}, []

    def reset(self, **row):
        self.table = {"alpha": "17", "beta": "23"}
        self.looked = []
        return " (key: alpha)"

    def lookup(self, key: str) -> str:
        """Read the table.

        Args:
            key: the key
        """
        self.looked.append(key)
        return self.table[key]

    def get_reward(self):
        return 1.0 if self.looked == ["alpha"] else 0.0
'''

REWARDS = '''
SEEN = []

def final_answer(prompts, completions, environments=None, **kw):
    SEEN.append([c[-1]["content"] for c in completions])
    return [1.0 if c[-1]["role"] == "assistant" and c[-1]["content"] == "17" else 0.0 for c in completions]
'''


def test_a_run_with_tools_and_an_environment(tiny_config, tmp_path, monkeypatch):
    (tmp_path / "env.py").write_text(ENV)
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "tools.py").write_text("def multiply(a: int, b: int) -> int:\n    '''Multiply.\n\n    Args:\n"
                                       "        a: a\n        b: b\n    '''\n    return a * b\n")
    cfg = grpo_config(tiny_config, tmp_path / "run", tools=["tools.py:multiply"], environment="env.py:Lookup",
                      reward_funcs=["rewards.py:final_answer"], max_completion_length=200)
    # This tokenizer spends a token on about every character, and Hermes' tool block is long: a
    # copy of the tiny model whose context holds it.
    model = tmp_path / "model"
    shutil.copytree(cfg["model"]["base_model"], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    cfg["model"]["base_model"] = str(model)
    cfg["data"]["sequence_len"] = 2048
    cfg["training"]["max_steps"] = 2
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    backend = create_backend("cpu")
    prompts_seen = []
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "alpha"}}\n</tool_call><|im_end|>'

    def sample(handle, prompts, max_new, stop, sampling, seed=None):
        tok = handle.tokenizer
        prompts_seen.append([tok.decode(p) for p in prompts])
        text = call if "tool_response>" not in tok.decode(prompts[0][-40:]) else "17<|im_end|>"
        return [tok(text, add_special_tokens=False)["input_ids"][:max_new] for _ in prompts]

    monkeypatch.setattr(backend, "sample", sample)
    result = run(load_config(path), backend)
    assert len(result.losses) == 2 and all(np.isfinite(result.losses))
    first = prompts_seen[0][0]
    assert "(key: alpha)<|im_end|>" in first                            # the observation, in the user turn
    assert '"name": "lookup"' in first and '"name": "multiply"' in first  # both tools offered (hermes block)
    rows = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert rows[0]["turns"][1] == {"role": "tool", "name": "lookup", "content": "17"}
    assert rows[0]["rewards"] == {"final_answer": 1.0, "Lookup": 1.0}
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["tools/call_frequency"] == 1.0 and metrics[0]["tools/failures"] == 0.0
    tok = load_tokenizer(cfg)
    model_tokens = len(tok(call, add_special_tokens=False)["input_ids"]) + len(tok("17<|im_end|>")["input_ids"])
    assert metrics[0]["completions/mean_length"] == model_tokens        # the tool's tokens are not counted


def load_tokenizer(cfg):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg["model"]["base_model"])


def test_a_tool_that_fails_to_import_stops_the_run_before_the_model_loads(tiny_config, tmp_path, monkeypatch):
    (tmp_path / "tools.py").write_text("import not_a_module\n")
    cfg = grpo_config(tiny_config, tmp_path / "run", tools=["tools.py:multiply"])
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    backend = create_backend("cpu")
    monkeypatch.setattr(backend, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(MudpuppyError, match=r"grpo.tools\[0\] tools.py:multiply: importing tools.py failed"):
        run(load_config(path), backend)
    assert not (tmp_path / "run").exists()
