"""`mudpuppy chat --backend mlx`: the run's adapter on MLX, streamed ids equal to the MLX protocol's."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("mlx.core")

from mudpuppy.backends.protocol import Sampling
from mudpuppy.cli import main
from mudpuppy.serving import GenerationOptions, load_chat_model

from .conftest import conversation

pytestmark = pytest.mark.mlx


@pytest.fixture(scope="module")
def mlx_chat(chat_run):
    return load_chat_model(str(chat_run), "mlx", "fp32")


def test_mlx_stream_equals_generate_and_sample(mlx_chat, torch_chat):
    backend, handle = mlx_chat.backend, mlx_chat.handle
    assert backend.name == "mlx"
    messages = conversation()[:2]
    prompt = mlx_chat.prompt_ids(messages)
    assert prompt == torch_chat.prompt_ids(messages)      # same tokenizer, same run template

    pieces: list[str] = []
    greedy = mlx_chat.complete(messages, GenerationOptions(max_new_tokens=12), pieces.append)
    expected = backend.generate(handle, [prompt], 12, mlx_chat.stop_ids)[0]
    assert greedy.token_ids == expected and expected
    assert "".join(pieces) == greedy.text == handle.tokenizer.decode(expected, skip_special_tokens=True)

    sampled = mlx_chat.complete(messages, GenerationOptions(max_new_tokens=12, temperature=0.9, top_k=40, seed=7))
    drawn = backend.sample(handle, [prompt], 12, mlx_chat.stop_ids, Sampling(0.9, 1.0, 40), 7)[0]
    assert sampled.token_ids == [t for t in drawn if t not in mlx_chat.stop_ids]


def test_mlx_chat_cli_from_a_pipe(mlx_chat, chat_run):
    result = CliRunner().invoke(main, ["chat", str(chat_run), "--backend", "mlx", "--precision", "fp32",
                                       "--max-new-tokens", "6"], input="Turn on the kitchen light.\n/quit\n")
    assert result.exit_code == 0, result.output
    assert "backend: mlx" in result.stderr
    expected = mlx_chat.complete([{"role": "user", "content": "Turn on the kitchen light."}],
                                 GenerationOptions(max_new_tokens=6)).text
    # split on "\n" only: random weights can write "\x1c" or "\x85", which str.splitlines() also breaks at
    assert result.stdout.rstrip("\n").split("\n") == [expected]


def test_mlx_serve_answers_plain_and_streaming(mlx_chat):
    import threading

    from mudpuppy.serving.server import start_server

    from .test_server import QUESTION, call, stream_events

    srv = start_server(mlx_chat, "127.0.0.1", 0, GenerationOptions(max_new_tokens=6, temperature=0.0),
                       log=lambda _line: None)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_port}/v1/chat/completions"
    try:
        status, body = call(url, {"messages": QUESTION})
        expected = mlx_chat.complete(QUESTION, GenerationOptions(max_new_tokens=6)).text
        assert status == 200 and body["choices"][0]["message"]["content"] == expected
        chunks = [json.loads(e) for e in stream_events(url, {"messages": QUESTION, "stream": True})[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    finally:
        srv.shutdown()
        srv.server_close()
