"""Talk to a trained model: `mudpuppy chat` (a terminal REPL) and `mudpuppy serve` (OpenAI's HTTP API).

    engine         a loaded model: messages rendered as training rendered them, text streamed out
    text           token ids to text as soon as it is final (whole characters, stop strings held back)
    streaming      token-by-token generation through the backend's `stream` (backends/*/streaming.py:
                   transformers' generate with a streamer on torch, the backend's own loops on MLX)
    chat           the REPL and its slash commands
    server         the OpenAI-compatible server (standard library only)

Generation goes through the same calls as `BackendProtocol.generate` and `sample`, with a hook
per token, so a streamed greedy answer is the one `mudpuppy eval` would score.
"""

from .engine import ChatModel, Completion, GenerationOptions, load_chat_model

__all__ = ["ChatModel", "Completion", "GenerationOptions", "load_chat_model"]
