"""Talk to a trained model: `mudpuppy chat` (a terminal REPL) and `mudpuppy serve` (OpenAI's HTTP API).

    engine         a loaded model: messages rendered as training rendered them, text streamed out
    text           token ids to text as soon as it is final (whole characters, stop strings held back)
    streaming      token-by-token generation through the backend's `stream` (backends/{torch/generation,mlx}/streaming.py:
                   transformers' generate with a streamer on torch, the backend's own loops on MLX)
    chat           the REPL and its slash commands
    server         the OpenAI-compatible server (standard library only): HTTP, shutdown
    requests       a request body checked into options and token limits, or an OpenAI error
    security       API key, Origin / Host / Content-Type rules against cross-site requests
    connections    the worker pool and its 503s, deadlines for slow clients (408), bodies drained after a
                   refusal, dropped connections logged
    bounds         how long a prompt may be (the context, in characters then tokens), for chat and serve
    literal        special-token text inside a message tokenized as text (no forged turns)
    scheduler      continuous batching: one thread owns the model and decodes every answer in one
                   batch through the backend's `open_decoder`

The chat REPL generates through the same calls as `BackendProtocol.generate` and `sample`, with a
hook per token; the server's batched decoder gives the same ids (tested), so a greedy answer is
the one `mudpuppy eval` would score either way.
"""

from .engine import ChatModel, Completion, GenerationOptions, load_chat_model

__all__ = ["ChatModel", "Completion", "GenerationOptions", "load_chat_model"]
