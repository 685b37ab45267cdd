"""Streaming on torch: transformers' `generate` called as the backend calls it, plus a streamer.

Greedy decoding repeats `TorchBackend.generate` argument for argument and sampling
repeats `backends/torch/sampling.sample` (a fresh GenerationConfig, the draw seeded
inside `fork_rng`), so the ids are the protocol's. The streamer receives the prompt
first, then each new token; to end early it raises, which leaves `generate` at once
without another forward pass.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from .decode_attention import packed_kv_heads_at_decode
from .sampling import fresh_generation_config


class Halt(Exception):
    """Raised by the streamer when the consumer wants no more tokens."""


class CallbackStreamer(BaseStreamer):
    def __init__(self, on_token):
        self.on_token = on_token
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:      # generate hands over the prompt first
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            if not self.on_token(int(token)):
                raise Halt

    def end(self) -> None:
        pass


@torch.no_grad()
def stream_ids(backend, handle, prompt, max_new_tokens, stop_ids, sampling, seed, on_token) -> None:
    model, device = handle.model, backend.plan.device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    attn = torch.ones_like(ids)
    streamer = CallbackStreamer(on_token)
    training = model.training
    model.eval()
    try:
        with packed_kv_heads_at_decode(device):
            run_generate(backend, handle, model, ids, attn, max_new_tokens, stop_ids, sampling, seed, streamer)
    except Halt:
        pass
    finally:
        model.train(training)


def run_generate(backend, handle, model, ids, attn, max_new_tokens, stop_ids, sampling, seed, streamer) -> None:
    device, pad = ids.device, handle.tokenizer.pad_token_id
    if sampling is None:
        with backend._autocast(handle):
            model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=stop_ids, pad_token_id=pad, use_cache=True, streamer=streamer)
        return
    config = GenerationConfig(
        do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        min_p=sampling.min_p, max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids), pad_token_id=pad,
        repetition_penalty=1.0, use_cache=True)
    gpu = [device] if device.type == "cuda" else []
    with fresh_generation_config(model), torch.random.fork_rng(devices=gpu, device_type=device.type):
        torch.manual_seed(seed)
        with backend._autocast(handle):
            model.generate(input_ids=ids, attention_mask=attn, generation_config=config, streamer=streamer)
