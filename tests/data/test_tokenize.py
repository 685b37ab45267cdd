"""Loss masks per format, shown as decoded text with the loss-carrying tokens in [[ ]]."""

from __future__ import annotations

import numpy as np
import pytest

from mudpuppy.data import LabeledExample, PairExample, PromptExample, StepExample, generation_prompt
from mudpuppy.data.formats import normalize_record
from mudpuppy.data.readers import Record
from mudpuppy.data.render import RenderOptions
from mudpuppy.data.report import mark_loss_tokens
from mudpuppy.data.templates import BUILTIN_TEMPLATES
from mudpuppy.data.tokenize import tokenize_records
from mudpuppy.errors import DataError

SYS = {"role": "system", "content": "Label it."}
USER = {"role": "user", "content": "lights off"}
BOT = {"role": "assistant", "content": "lights_off"}


def tokenize(tok, fmt, *records, **opts):
    recs = [Record(normalize_record(fmt, r), i + 1, i + 1) for i, r in enumerate(records)]
    options = RenderOptions(**{"chat": bool(tok.chat_template), **opts})
    return tokenize_records(tok, fmt, recs, options, "d.jsonl")


def marked(tok, ex) -> str:
    return mark_loss_tokens(tok, ex)


def test_chat_trains_assistant_turns_and_their_end_marker(tok):
    ex = tokenize(tok, "chat", {"messages": [SYS, USER, BOT]})[0]
    assert marked(tok, ex) == ("<|im_start|>system\nLabel it.<|im_end|>\n<|im_start|>user\nlights off<|im_end|>\n"
                               "<|im_start|>assistant\n[[lights_off<|im_end|>]]\n")
    assert ex.source == "d.jsonl:1" and ex.input_ids.dtype == np.int32 and ex.loss_mask.dtype == bool


def test_chat_multi_turn(tok):
    msgs = [USER, BOT, {"role": "user", "content": "and on"}, {"role": "assistant", "content": "lights_on"}]
    text = marked(tok, tokenize(tok, "chat", {"messages": msgs})[0])
    assert text.count("[[") == 2 and "[[lights_off<|im_end|>]]" in text and "[[lights_on<|im_end|>]]" in text


def test_roles_to_train_leave_headers_out(tok):
    ex = tokenize(tok, "chat", {"messages": [SYS, USER, BOT]}, roles=frozenset({"user", "assistant"}))[0]
    assert "<|im_start|>user\n[[lights off<|im_end|>]]" in marked(tok, ex)
    assert "[[Label it." not in marked(tok, ex)


def test_a_message_train_flag_overrides_its_role(tok):
    msgs = [{**USER, "train": True}, {**BOT, "train": False}, {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y"}]
    text = marked(tok, tokenize(tok, "chat", {"messages": msgs})[0])
    assert "[[lights off<|im_end|>]]" in text and "[[lights_off" not in text and "[[y<|im_end|>]]" in text


@pytest.mark.parametrize("policy,expected", [
    ("turn", ["[[a<|im_end|>]]", "[[b<|im_end|>]]"]),
    ("last", ["[[a]]<|im_end|>", "[[b<|im_end|>]]"]),
    ("none", ["[[a]]<|im_end|>", "[[b]]<|im_end|>"]),
])
def test_train_on_eos_policies(tok, policy, expected):
    msgs = [USER, {"role": "assistant", "content": "a"}, USER, {"role": "assistant", "content": "b"}]
    text = marked(tok, tokenize(tok, "chat", {"messages": msgs}, train_on_eos=policy)[0])
    assert all(e in text for e in expected), text


def test_train_on_inputs_trains_every_message(tok):
    ex = tokenize(tok, "chat", {"messages": [SYS, USER, BOT]}, train_on_inputs=True)[0]
    assert marked(tok, ex).count("[[") == 3


def test_text_trains_everything_and_ends_with_eos(tok):
    ex = tokenize(tok, "text", {"text": "hello world"})[0]
    assert ex.input_ids[-1] == tok.eos_token_id and ex.loss_mask.all()
    ex = tokenize(tok, "text", {"text": "hello world"}, train_on_eos="none")[0]
    assert ex.loss_mask[:-1].all() and not ex.loss_mask[-1]


def test_instruction_through_the_chat_template(tok):
    ex = tokenize(tok, "instruction", {"instruction": "Classify", "input": "lights off", "output": "lights_off"})[0]
    assert marked(tok, ex) == ("<|im_start|>user\nClassify\n\nlights off<|im_end|>\n"
                               "<|im_start|>assistant\n[[lights_off<|im_end|>]]\n")


def test_instruction_raw_uses_the_alpaca_layout(tok):
    ex = tokenize(tok, "instruction", {"instruction": "Classify", "input": "lights off", "output": "lights_off"},
                  chat=False)[0]
    text = marked(tok, ex)
    assert text.startswith("Below is an instruction") and "### Input:\nlights off\n\n### Response:\n" in text
    assert text.endswith("[[lights_off<|im_end|>]]")


def test_instruction_system_field_and_system_prompt(tok):
    ex = tokenize(tok, "instruction", {"instruction": "Classify", "output": "x", "system": "Be terse."},
                  system_prompt="ignored when the record has its own")[0]
    assert marked(tok, ex).startswith("<|im_start|>system\nBe terse.<|im_end|>")
    ex = tokenize(tok, "completion", {"prompt": "p", "completion": "c"}, system_prompt="Be kind.")[0]
    assert marked(tok, ex).startswith("<|im_start|>system\nBe kind.<|im_end|>")


def test_completion_raw_masks_the_prompt(tok):
    ex = tokenize(tok, "completion", {"prompt": "Command: lock it\nIntent:", "completion": " door_lock"},
                  chat=False)[0]
    assert marked(tok, ex) == "Command: lock it\nIntent:[[ door_lock<|im_end|>]]"
    ex = tokenize(tok, "completion", {"prompt": "Command: lock it\nIntent:", "completion": " door_lock"},
                  chat=False, train_on_inputs=True)[0]
    assert ex.loss_mask.all()


def test_preference_pairs_share_the_prompt(tok):
    pair = tokenize(tok, "preference", {"prompt": "lights off", "chosen": "lights_off", "rejected": "no"})[0]
    assert isinstance(pair, PairExample)
    assert marked(tok, pair.chosen).endswith("assistant\n[[lights_off<|im_end|>]]\n")
    assert marked(tok, pair.rejected).endswith("assistant\n[[no<|im_end|>]]\n")
    first_trained = int(np.argmax(pair.chosen.loss_mask))
    assert np.array_equal(pair.chosen.input_ids[:first_trained], pair.rejected.input_ids[:first_trained])


def test_preference_with_message_lists_trains_only_the_responses(tok):
    rec = {"prompt": [USER, BOT, {"role": "user", "content": "again"}],
           "chosen": [{"role": "assistant", "content": "yes"}], "rejected": [{"role": "assistant", "content": "no"}]}
    pair = tokenize(tok, "preference", rec)[0]
    assert marked(tok, pair.chosen).count("[[") == 1 and "[[yes<|im_end|>]]" in marked(tok, pair.chosen)


def test_preference_raw_strings(tok):
    pair = tokenize(tok, "preference", {"prompt": "Q: hi\nA:", "chosen": " hello", "rejected": " go"}, chat=False)[0]
    assert marked(tok, pair.chosen) == "Q: hi\nA:[[ hello<|im_end|>]]"


def test_kto_keeps_its_label(tok):
    ex = tokenize(tok, "kto", {"prompt": "p", "completion": "c", "label": False})[0]
    assert isinstance(ex, LabeledExample) and ex.label is False
    assert marked(tok, ex.example).endswith("[[c<|im_end|>]]\n")


def test_reward_marks_the_last_token_where_the_score_is_read(tok):
    ex = tokenize(tok, "reward", {"text": "Intent: door_lock", "label": 0.5})[0]
    assert isinstance(ex, LabeledExample) and ex.label == 0.5
    assert ex.example.loss_mask.sum() == 1 and ex.example.loss_mask[-1]
    assert ex.example.input_ids[-1] == tok.eos_token_id


def test_rl_prompt_ends_with_the_generation_prompt_and_keeps_fields(tok):
    ex = tokenize(tok, "rl", {"prompt": "What is 6*7?", "answer": "42", "difficulty": 1})[0]
    assert isinstance(ex, PromptExample)
    assert ex.fields == {"prompt": "What is 6*7?", "answer": "42", "difficulty": 1}   # the prompt as written too
    text = tok.decode(ex.prompt.input_ids)
    assert text.endswith("<|im_start|>assistant\n") and not ex.prompt.loss_mask.any()


def test_prm_marks_one_token_per_step(tok):
    rec = {"prompt": "2+3*4?", "completions": ["3*4 = 12", "2 + 12 = 14"], "labels": [True, False]}
    ex = tokenize(tok, "prm", rec)[0]
    assert isinstance(ex, StepExample) and ex.step_labels.tolist() == [True, False]
    marked_ids = ex.example.input_ids[ex.example.loss_mask]
    assert len(marked_ids) == 2
    assert tok.decode(marked_ids[-1:]).endswith("4")
    assert tok.decode(ex.example.input_ids) == "2+3*4?\n3*4 = 12\n2 + 12 = 14"


def test_chat_data_without_a_template_names_both_fixes(tok):
    tok.chat_template = None
    with pytest.raises(DataError) as err:
        tokenize(tok, "chat", {"messages": [USER, BOT]})
    msg = str(err.value)
    assert msg.startswith("d.jsonl: chat data needs a chat template") and "data.chat_template" in msg
    assert "chatml" in msg and "tokenizer that ships one" in msg


def test_prompt_formats_without_a_template_fall_back_to_raw(tok):
    tok.chat_template = None
    ex = tokenize(tok, "completion", {"prompt": "a", "completion": "b"})[0]
    assert marked(tok, ex) == "a[[b<|im_end|>]]"
    with pytest.raises(DataError, match="chat template"):
        tokenize(tok, "completion", {"prompt": [USER], "completion": "b"})


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    tok.chat_template = ("{% for m in messages %}{{ m['role'] + ':' + m['content'] + '|' + (messages|length|string) }}"
                         "{% endfor %}")
    with pytest.raises(DataError, match="set data.chat_template to a built-in"):
        tokenize(tok, "chat", {"messages": [USER, BOT]})


@pytest.mark.parametrize("name", list(BUILTIN_TEMPLATES))
def test_builtin_templates_mask_only_the_answers(tok, name):
    tok.chat_template = BUILTIN_TEMPLATES[name].jinja
    msgs = [SYS, USER, BOT, {"role": "user", "content": "now on"}, {"role": "assistant", "content": "lights_on"}]
    ex = tokenize(tok, "chat", {"messages": msgs})[0]
    trained = tok.decode(ex.input_ids[ex.loss_mask])
    assert trained.lstrip().startswith("lights_off") and "lights_on" in trained
    assert "Label it" not in trained and "lights off" not in trained and "now on" not in trained


@pytest.mark.parametrize("name", ["tokenizer", *BUILTIN_TEMPLATES])
def test_generation_prompt_is_the_prefix_training_saw(tok, name):
    if name != "tokenizer":
        tok.chat_template = BUILTIN_TEMPLATES[name].jinja
    msgs = [SYS, USER, BOT]
    ex = tokenize(tok, "chat", {"messages": msgs})[0]
    prompt_ids, reference = generation_prompt(tok, msgs)
    assert reference == "lights_off"
    assert ex.input_ids[: len(prompt_ids)].tolist() == prompt_ids
    assert not ex.loss_mask[: len(prompt_ids)].any() and ex.loss_mask[len(prompt_ids)]


class SlowTokenizer:
    """The tiny tokenizer pretending to be one without offsets."""

    is_fast = False

    def __init__(self, fast):
        self.fast = fast
        self.eos_token_id = fast.eos_token_id
        self.chat_template = fast.chat_template

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": self.fast(text, add_special_tokens=add_special_tokens)["input_ids"]}

    def apply_chat_template(self, *args, **kwargs):
        return self.fast.apply_chat_template(*args, **kwargs)


def test_tokenizers_without_offsets_still_get_masks(tok):
    ex = tokenize(SlowTokenizer(tok), "chat", {"messages": [SYS, USER, BOT]})[0]
    fast = tokenize(tok, "chat", {"messages": [SYS, USER, BOT]})[0]
    assert tok.decode(ex.input_ids[ex.loss_mask]) == "lights_off<|im_end|>"
    assert np.array_equal(ex.input_ids, fast.input_ids) and np.array_equal(ex.loss_mask, fast.loss_mask)


@pytest.mark.parametrize("name,content", [("llama3", "t"), ("chatml", "end"), ("gemma", "of"), ("llama2", "INST")])
def test_content_that_echoes_the_template_markers(tok, name, content):
    # Searching the turn's text for its content would find it inside the header or
    # marker; the turn's frame, learnt from a sentinel rendering, does not.
    tok.chat_template = BUILTIN_TEMPLATES[name].jinja
    msgs = [{"role": "user", "content": content}, {"role": "assistant", "content": content}]
    ex = tokenize(tok, "chat", {"messages": msgs}, roles=frozenset({"user", "assistant"}), train_on_eos="none")[0]
    trained = tok.decode(ex.input_ids[ex.loss_mask])
    assert trained.replace(" ", "") == content * 2
