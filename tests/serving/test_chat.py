"""`mudpuppy chat`: training's rendering, streaming equal to the protocol, the REPL under a pty and a pipe."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from mudpuppy import load_config
from mudpuppy.backends.protocol import Sampling
from mudpuppy.cli import main
from mudpuppy.data import load_data
from mudpuppy.serving import GenerationOptions
from mudpuppy.serving.text import TextStream

from .conftest import RUN_TEMPLATE, conversation, write_jsonl


def training_examples(run_dir: Path, data: Path):
    """The records of `data` tokenized by the training path (prepare_data) with the run's own config."""
    from transformers import AutoTokenizer

    from mudpuppy.data import prepare_data

    raw = yaml.safe_load((run_dir / "config.yaml").read_text())
    raw["data"].update(datasets=[{"path": str(data)}], val_datasets=[])
    cfg = load_config(raw)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.base_model)   # the base's: chatml, not the run's zephyr
    return prepare_data(cfg, tokenizer, use_cache=False).train, tokenizer


def test_prompt_at_chat_time_is_the_training_rendering(torch_chat, chat_run, tmp_path):
    messages = conversation()
    examples, tokenizer = training_examples(chat_run, write_jsonl(tmp_path / "one.jsonl", [{"messages": messages}]))
    ids, mask = examples[0].input_ids.tolist(), examples[0].loss_mask
    # Where each trained (assistant) turn starts: a loss token after a prompt token.
    starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
    assistant_turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(starts) == len(assistant_turns) == 2
    training_text = tokenizer.decode(ids)
    for start, turn in zip(starts, assistant_turns):
        history = messages[:turn]
        assert torch_chat.prompt_ids(history) == ids[:start]
        assert training_text.startswith(torch_chat.render(history))
    # The run's template (zephyr), not the one the base tokenizer ships (chatml).
    assert RUN_TEMPLATE == "zephyr" and "<|user|>" in torch_chat.render(messages[:2])
    assert "<|im_start|>" not in torch_chat.render(messages[:2])


def test_streamed_answer_is_the_protocols(torch_chat):
    backend, handle = torch_chat.backend, torch_chat.handle
    messages = conversation()[:2]
    prompt = torch_chat.prompt_ids(messages)
    pieces: list[str] = []
    greedy = torch_chat.complete(messages, GenerationOptions(max_new_tokens=24), pieces.append)
    expected = backend.generate(handle, [prompt], 24, torch_chat.stop_ids)[0]
    assert greedy.token_ids == expected and len(expected) > 0
    assert "".join(pieces) == greedy.text == handle.tokenizer.decode(expected, skip_special_tokens=True)
    assert greedy.prompt_tokens == len(prompt)

    options = GenerationOptions(max_new_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=11)
    sampled = torch_chat.complete(messages, options)
    drawn = backend.sample(handle, [prompt], 24, torch_chat.stop_ids, Sampling(0.9, 0.95, 50), 11)[0]
    assert sampled.token_ids == [t for t in drawn if t not in torch_chat.stop_ids]
    assert sampled.token_ids != greedy.token_ids     # the sampler was used


def test_text_stream_holds_back_half_characters_and_stop_strings(torch_chat):
    tok = torch_chat.tokenizer
    text = "héllo wörld ✓ the END of it"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, stop=("END", "never"))
    pieces = []
    for token in ids:
        pieces.append(stream.add(token))
        if stream.stopped:
            break
    pieces.append(stream.flush())
    assert "".join(pieces) == stream.text == "héllo wörld ✓ the "
    assert not any("\ufffd" in p for p in pieces)
    assert stream.stopped
    # With no stop string the pieces are the whole decoded text.
    whole = TextStream(tok)
    assert "".join([whole.add(t) for t in ids] + [whole.flush()]) == text


def saved_records(path: Path) -> list[dict]:
    """The file read back through mudpuppy's data layer, as a training dataset."""
    cfg = load_config({"model": {"base_model": "unused"}, "data": {"datasets": [{"path": str(path)}]},
                       "output_dir": str(path.parent / "out")})
    loaded = load_data(cfg)
    assert loaded.train[0].format == "chat"
    return [r.data for r in loaded.train[0].records]


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def read_until(fd: int, wanted: str, seen: str, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while wanted not in ANSI.sub("", seen).replace("\r\n", "\n"):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {wanted!r} in the terminal within {timeout} s; it shows:\n{seen}")
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                seen += os.read(fd, 4096).decode("utf-8", "replace")
            except OSError:       # the child closed the terminal
                break
    return seen


def test_chat_under_a_pseudo_terminal(torch_chat, chat_run, tmp_path):
    import pty

    expected = torch_chat.complete([{"role": "user", "content": "Turn on the kitchen light."}],
                                   GenerationOptions(max_new_tokens=8)).text
    saved = tmp_path / "talk.jsonl"
    main_fd, child_fd = pty.openpty()
    env = {**os.environ, "TERM": "dumb"}
    proc = subprocess.Popen([sys.executable, "-m", "mudpuppy", "chat", str(chat_run), "--precision", "fp32",
                             "--max-new-tokens", "8"], stdin=child_fd, stdout=child_fd, stderr=child_fd, env=env,
                            close_fds=True)
    os.close(child_fd)
    try:
        assert "/help for commands" in read_until(main_fd, "commands\n> ", "")
        os.write(main_fd, b"Turn on the kitchen light.\n")
        # The terminal echoes the line, then the answer streams, then the next prompt.
        shown = ANSI.sub("", read_until(main_fd, "\n> ", "")).replace("\r\n", "\n")
        assert expected.strip() and f"Turn on the kitchen light.\n{expected}\n> " in shown
        os.write(main_fd, f"/save {saved}\n".encode())
        read_until(main_fd, "saved 1 answer", "")
        os.write(main_fd, b"/quit\n")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(main_fd)
    records = saved_records(saved)
    assert records == [{"messages": [{"role": "user", "content": "Turn on the kitchen light."},
                                     {"role": "assistant", "content": expected}]}]


def test_chat_from_a_pipe_with_commands(torch_chat, chat_run, tmp_path):
    saved = tmp_path / "piped.jsonl"
    saved.write_text(json.dumps({"messages": [{"role": "user", "content": "earlier"},
                                              {"role": "assistant", "content": "record"}]}))  # no final newline
    script = f"first question\n/reset\n/system Be brief.\n/bogus\nsecond question\n/save {saved}\n/quit\nnot read\n"
    result = CliRunner().invoke(main, ["chat", str(chat_run), "--precision", "fp32", "--max-new-tokens", "6",
                                       "--temperature", "0.8", "--seed", "5"], input=script)
    assert result.exit_code == 0, result.output
    assert "unknown command /bogus" in result.stderr and "system prompt: Be brief." in result.stderr
    answers = result.stdout.splitlines()
    # The seed steps by one per answer, and /reset restarts the count: both answers are drawn with seed 5.
    options = GenerationOptions(max_new_tokens=6, temperature=0.8, seed=5)
    first = torch_chat.complete([{"role": "user", "content": "first question"}], options).text
    system = [{"role": "system", "content": "Be brief."}]
    second = torch_chat.complete(system + [{"role": "user", "content": "second question"}], options).text
    assert answers == [first, second]
    records = saved_records(saved)
    assert records[0]["messages"][1]["content"] == "record"
    assert records[1] == {"messages": system + [{"role": "user", "content": "second question"},
                                                {"role": "assistant", "content": second}]}


def test_chat_refuses_what_it_cannot_talk_to(tiny_model_dir, tmp_path):
    missing = CliRunner().invoke(main, ["chat", str(tmp_path / "nowhere")], input="hi\n")
    assert missing.exit_code == 2 and "nowhere: no such file or directory" in missing.stderr

    bare = tmp_path / "no-template"
    bare.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name != "chat_template.jinja":
            (bare / f.name).write_bytes(f.read_bytes())
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["chat", str(bare)], input="hi\n")
    assert result.exit_code == 2 and "has no chat template" in result.stderr and "--chat-template" in result.stderr
    assert "Traceback" not in result.output
    # A built-in template on the command line makes the same model usable.
    fixed = CliRunner().invoke(main, ["chat", str(bare), "--chat-template", "chatml", "--max-new-tokens", "3"],
                               input="hi\n")
    assert fixed.exit_code == 0, fixed.output
    assert len(fixed.stdout.splitlines()) == 1


@pytest.mark.parametrize("line, reply", [("/save", "/save needs a file name"),
                                         ("/save notes.txt", "name a .jsonl file"),
                                         ("/save x.jsonl", "nothing to save yet")])
def test_save_refusals_keep_the_session(torch_chat, line, reply, tmp_path, monkeypatch):
    from mudpuppy.serving.chat import ChatSession

    monkeypatch.chdir(tmp_path)
    session = ChatSession(torch_chat, GenerationOptions(max_new_tokens=2))
    assert reply in session.command(line)
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "notes.txt").exists()
