"""`backend.open_decoder`: sequences joining and leaving a batch get the answers they get alone."""

from __future__ import annotations

import pytest

from mudpuppy.backends.protocol import Sampling

from .conftest import conversation

SAMPLING = Sampling(temperature=1.3, top_p=0.9, top_k=40)


def prompts(model) -> list[list[int]]:
    """Prompts of different lengths, so the batch is left-padded."""
    turns = conversation()
    return [model.prompt_ids(turns[:2]), model.prompt_ids(turns[:4]), model.prompt_ids([turns[1]]),
            model.prompt_ids([{"role": "user", "content": "Dim the lights, please, to about a third."}])]


def run_staggered(decoder, requests: list[tuple[list[int], Sampling | None, int]], new_tokens: int) -> list[list[int]]:
    """Add one request every two steps, remove each after `new_tokens` tokens: joins and leaves mid-batch."""
    got: dict[int, list[int]] = {}
    slots: dict[int, int] = {}
    waiting = list(enumerate(requests))
    while waiting or slots:
        if waiting:
            index, (prompt, sampling, seed) = waiting.pop(0)
            slots[decoder.add(prompt, sampling, seed)] = index
        for _ in range(2):
            for slot, token in decoder.step().items():
                got.setdefault(slots[slot], []).append(token)
            for slot in [s for s, i in slots.items() if len(got.get(i, [])) >= new_tokens]:
                decoder.remove(slot)
                del slots[slot]
    return [got[i] for i in range(len(requests))]


def check_decoder(model, new_tokens: int) -> None:
    backend, handle = model.backend, model.handle
    ps = prompts(model)
    alone = [backend.generate(handle, [p], new_tokens, [])[0] for p in ps]
    decoder = backend.open_decoder(handle)
    try:
        batched = run_staggered(decoder, [(p, None, 0) for p in ps], new_tokens)
        assert max(decoder.batch_sizes()) > 1
    finally:
        decoder.close()
    assert batched == alone

    streamed = []
    for i, p in enumerate(ps):
        ids: list[int] = []
        backend.stream(handle, p, new_tokens, [], SAMPLING, 10 + i, lambda t, ids=ids: ids.append(t) or True)
        streamed.append(ids)
    mixed = [(p, SAMPLING if i % 2 else None, 10 + i) for i, p in enumerate(ps)]
    decoder = backend.open_decoder(handle)
    try:
        got = run_staggered(decoder, mixed, new_tokens)
    finally:
        decoder.close()
    for i in range(len(ps)):
        assert got[i] == (streamed[i] if i % 2 else alone[i]), i


def test_torch_batched_decoding_equals_single_requests(torch_chat):
    check_decoder(torch_chat, 12)


@pytest.mark.mlx
def test_mlx_batched_decoding_equals_single_requests(chat_run):
    pytest.importorskip("mlx.core")
    from mudpuppy.serving import load_chat_model

    check_decoder(load_chat_model(str(chat_run), "mlx", "fp32"), 5)


def check_failures_end_alone(model, new_tokens: int) -> None:
    """Two sequences whose draws fail: one sampled at temperature 1e-300 (0 in float32: its scores are inf
    and NaN) fails at its first draw, before it joins the batch; one whose scores turn NaN at its third
    step fails as a row between two others. Each is removed and reported by `failures`; the sequences
    beside them decode what they decode alone."""
    backend, handle = model.backend, model.handle
    ps = prompts(model)
    alone = [backend.generate(handle, [p], new_tokens, [])[0] for p in ps]
    decoder = backend.open_decoder(handle)
    real, drawn = decoder.draw, {}

    def draw(seq):
        drawn[id(seq)] = drawn.get(id(seq), 0) + 1
        if seq is poisoned and drawn[id(seq)] == 3:
            seq.logits = seq.logits * float("nan")
        return real(seq)

    decoder.draw = draw
    try:
        kept = [decoder.add(ps[0], None, 0)]
        doomed = decoder.add(ps[1], None, 0)
        poisoned = decoder.seqs[doomed]
        kept.append(decoder.add(ps[3], None, 0))
        broken = decoder.add(ps[2], Sampling(temperature=1e-300), 7)
        got: dict[int, list[int]] = {slot: [] for slot in kept}
        failed: dict = {}
        for _ in range(new_tokens):
            for slot, token in decoder.step().items():
                assert slot not in failed and slot != broken
                got.setdefault(slot, []).append(token)
            failed.update(decoder.failures())
        assert sorted(failed) == sorted([doomed, broken]), failed
        assert all("not finite" in str(exc) for exc in failed.values())
        assert len(got[doomed]) == 2 and max(decoder.batch_sizes()) == 3
    finally:
        decoder.close()
    assert [got[slot] for slot in kept] == [alone[0], alone[3]]


def test_torch_a_failed_draw_ends_its_sequence_alone(torch_chat):
    check_failures_end_alone(torch_chat, 8)


@pytest.mark.mlx
def test_mlx_a_failed_draw_ends_its_sequence_alone(chat_run):
    pytest.importorskip("mlx.core")
    from mudpuppy.serving import load_chat_model

    check_failures_end_alone(load_chat_model(str(chat_run), "mlx", "fp32"), 5)
