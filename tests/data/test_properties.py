"""Property tests: masks never mark prompt tokens; packing neither drops nor duplicates tokens."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mudpuppy.data import Example, collate, collate_packed, pack_sequences
from mudpuppy.data.batching import group_by_token_budget
from mudpuppy.data.readers import Record
from mudpuppy.data.render import RenderOptions, render_chat
from mudpuppy.data.templates import BUILTIN_TEMPLATES
from mudpuppy.data.tokenize import tokenize_records

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Text a user might write: letters, digits, punctuation, spaces, newlines and some non-ASCII.
# Template markers ("<|", "[INST]") are left out: content that forges them is a different problem.
# Letters of the markers' names (eot, im_end, INST, model...) are in, so content can echo them.
text = st.text(alphabet=st.sampled_from(list("adeilmnorstuxyz _ISTN019.,:;!?-'\"\n\téü中🙂")), min_size=0, max_size=24)


@st.composite
def conversations(draw):
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(text)})
    for _ in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(text)})
        msgs.append({"role": "assistant", "content": draw(text)})
    return msgs


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def offsets_of(tokenizer, ids_text: str) -> np.ndarray:
    return np.asarray(tokenizer(ids_text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"])


@SETTINGS
@given(msgs=conversations(), template=st.sampled_from(["tokenizer", *BUILTIN_TEMPLATES]),
       eos=st.sampled_from(["turn", "last", "none"]))
def test_chat_masks_never_mark_prompt_tokens(tokenizer, msgs, template, eos):
    from tests.conftest import CHATML

    tokenizer.chat_template = CHATML if template == "tokenizer" else BUILTIN_TEMPLATES[template].jinja
    ex = tokenize_records(tokenizer, "chat", [Record({"messages": msgs}, 1, 1)], RenderOptions(train_on_eos=eos),
                          "p.jsonl")[0]
    full = render_chat(tokenizer, msgs)
    # What the model answers: from the end of each assistant turn's generation prompt to the end of that turn.
    answers = [(len(render_chat(tokenizer, msgs[:i], add_generation_prompt=True)), len(render_chat(tokenizer, msgs[: i + 1])))
               for i, m in enumerate(msgs) if m["role"] == "assistant"]
    starts = offsets_of(tokenizer, full)[:, 0]
    assert len(starts) == len(ex.input_ids)
    for t in np.flatnonzero(ex.loss_mask):
        assert any(lo <= starts[t] < hi for lo, hi in answers), (full, t)
    if eos == "none":   # no end-of-turn marker trained: no masked token holds a "<" (the text has none)
        assert all("<" not in tokenizer.decode([t]) for t in ex.input_ids[ex.loss_mask]), full
    # And every answer with visible content is trained on.
    for (lo, hi), m in zip(answers, [m for m in msgs if m["role"] == "assistant"]):
        if m["content"].strip():
            assert ex.loss_mask[(starts >= lo) & (starts < hi)].any()


@SETTINGS
@given(prompt=text, completion=text.filter(lambda s: s.strip()), chat=st.booleans())
def test_completion_masks_never_mark_prompt_tokens(tokenizer, prompt, completion, chat):
    from tests.conftest import CHATML

    tokenizer.chat_template = CHATML
    rec = Record({"prompt": prompt, "completion": completion}, 1, 1)
    ex = tokenize_records(tokenizer, "completion", [rec], RenderOptions(chat=chat), "p.jsonl")[0]
    if chat:
        msgs = [{"role": "user", "content": prompt}]
        boundary = len(render_chat(tokenizer, msgs, add_generation_prompt=True))
        starts = offsets_of(tokenizer, render_chat(tokenizer, msgs + [{"role": "assistant", "content": completion}]))[:, 0]
    else:
        boundary = len(prompt)
        starts = offsets_of(tokenizer, prompt + completion)[:, 0]
        starts = np.append(starts, len(prompt + completion))        # the appended EOS
    assert not ex.loss_mask[starts < boundary].any()
    assert ex.loss_mask.any()


lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=60)


@SETTINGS
@given(lengths=lengths_st, capacity=st.integers(40, 120))
def test_packing_neither_drops_nor_duplicates_tokens(lengths, capacity):
    rng = np.random.default_rng(len(lengths))
    exs = [Example(rng.integers(3, 300, n).astype(np.int32), rng.random(n) < 0.7) for n in lengths]
    rows = pack_sequences(lengths, capacity)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= capacity for row in rows)
    batch = collate_packed([[exs[i] for i in row] for row in rows], pad_id=0)
    for r, row in enumerate(rows):
        for seg, i in enumerate(row, start=1):
            here = batch.segment_ids[r] == seg
            assert np.array_equal(batch.input_ids[r][here], exs[i].input_ids)
            assert np.array_equal(batch.position_ids[r][here], np.arange(lengths[i]))
    assert batch.real_tokens == sum(lengths)
    assert batch.loss_tokens == collate(exs, pad_id=0).loss_tokens


@SETTINGS
@given(lengths=lengths_st, budget=st.integers(40, 200), seed=st.integers(0, 5))
def test_token_budget_batches_cover_everything_within_budget(lengths, budget, seed):
    batches = group_by_token_budget(lengths, budget, seed)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= budget for b in batches)
