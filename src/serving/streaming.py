"""Token-by-token generation for one prompt, on the backend's runtime.

`stream_ids` hands each generated id to `on_token` as soon as it exists, the stop
token included; `on_token` returns False to end the answer early (a stop string, a
client gone). The loops are the backend's own calls with a hook added, so:

- greedy (`sampling` None) yields what `BackendProtocol.generate` returns, then the stop token;
- sampled yields what `BackendProtocol.sample` returns for the same prompt and seed.

The runtime code is each backend's `stream` (backends/torch/generation/streaming.py, backends/mlx/streaming.py).
"""

from __future__ import annotations

from typing import Callable

from ..backends.protocol import Sampling
from ..errors import MudpuppyError

OnToken = Callable[[int], bool]


def stream_ids(backend, handle, prompt: list[int], max_new_tokens: int, stop_ids: list[int],
               sampling: Sampling | None, seed: int, on_token: OnToken) -> None:
    if not prompt:
        raise MudpuppyError("generation needs a prompt of at least one token")
    if max_new_tokens <= 0:
        return
    backend.stream(handle, prompt, max_new_tokens, stop_ids, sampling, seed, on_token)
