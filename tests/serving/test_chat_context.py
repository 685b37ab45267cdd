"""`mudpuppy chat` refuses a message the model's context cannot hold, with serve's bound (bounds.py): by
characters before tokenizing, then by tokens. At a prompt the chat goes on; from a pipe it stops (exit 2)."""

from __future__ import annotations

import io

import pytest

from mudpuppy.serving import GenerationOptions
from mudpuppy.serving.bounds import PromptBound

from .test_chat_input import chat

CONTEXT = 512          # the tiny model's max_position_embeddings


def too_long(model, by: str) -> str:
    """A message over the character bound, or under it and still more tokens than the context holds."""
    bound = PromptBound.of(model)
    assert bound.context == CONTEXT and bound.chars is not None
    text = "light " * (bound.chars // 6 + 10) if by == "chars" else "a b c d " * 200
    assert (len(text) > bound.chars) == (by == "chars")
    assert by == "chars" or len(model.tokenizer(text)["input_ids"]) > CONTEXT
    return text


@pytest.mark.parametrize("by, said", [("chars", "characters, more than 512 tokens can hold"),
                                      ("tokens", "your messages resulted in")])
def test_at_a_prompt_a_message_too_long_for_the_context_is_refused_and_the_chat_goes_on(torch_chat, by, said):
    from mudpuppy.serving.chat import ChatSession, run_chat

    expected = torch_chat.complete([{"role": "user", "content": "hello"}], GenerationOptions(max_new_tokens=6)).text
    stdin = io.StringIO(f"{too_long(torch_chat, by)}\nhello\n/quit\n")
    out, err = io.StringIO(), io.StringIO()
    session = ChatSession(torch_chat, GenerationOptions(max_new_tokens=6))
    run_chat(session, stdin, out, err, interactive=True)
    lines = [line for line in err.getvalue().splitlines() if "maximum context length" in line]
    assert len(lines) == 1 and "This model's maximum context length is 512 tokens" in lines[0] and said in lines[0]
    assert "left out" in lines[0]
    assert out.getvalue() == f"> > {expected}\n> "              # the refused message has no answer
    assert [m["content"] for m in session.messages] == ["hello", expected]


def test_a_long_answer_stops_at_the_end_of_the_context(torch_chat, nonstop):
    from mudpuppy.serving.chat import ChatSession

    session = ChatSession(nonstop, GenerationOptions(max_new_tokens=10_000))
    text = "a b c d " * 75                        # some 470 tokens: 512 leaves room for a few more
    done = session.reply(text)
    assert done.prompt_tokens < CONTEXT and done.prompt_tokens + done.completion_tokens == CONTEXT


def test_from_a_pipe_a_message_too_long_for_the_context_ends_the_chat_with_exit_2(chat_run, torch_chat):
    first = torch_chat.complete([{"role": "user", "content": "Turn on the kitchen light."}],
                                GenerationOptions(max_new_tokens=6)).text
    long = too_long(torch_chat, "chars")
    result = chat(chat_run, f"Turn on the kitchen light.\n{long}\nnot read\n".encode())
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "a message read from stdin is too long: This model's maximum context length is 512 tokens" in err
    assert "Traceback" not in err
    assert result.stdout.decode("utf-8") == first + "\n"       # the answers before it stand
