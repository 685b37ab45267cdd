"""The built-in rewards on text and chat-shaped completions, with hand-computed values."""

from __future__ import annotations

import pytest
from mudpuppy.rewards import BUILTINS, parse_reward_specs
from mudpuppy.rewards.text import answer_tag, completion_text, normalize, numbers_in


def build(item):
    (spec,) = parse_reward_specs([item], None)
    return BUILTINS[spec.target](**dict(spec.options))


def chat(texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


def run(fn, texts, shape="text", **columns):
    completions = texts if shape == "text" else chat(texts)
    ids = [list(range(len(t))) for t in texts]
    prompts = ["q"] * len(texts) if shape == "text" else [[{"role": "user", "content": "q"}]] * len(texts)
    return fn(prompts=prompts, completions=completions, completion_ids=ids, **columns)


# ------------------------------------------------------------------ text helpers


@pytest.mark.parametrize("raw, expected", [
    ("42", "42"), ("42.0", "42"), ("+42", "42"), ("4,200", "4200"), ("$4,200.00", "4200"), ("50%", "50"),
    (".50", "0.5"), ("-3", "-3"), ("-0.0", "0"), ("1,5", "1,5"), ('"Paris."', "paris"), ("**42**", "42"),
    ("  The   Capital\nof France ", "the capital of france"), ("(b)", "b"), ("\u201cyes\u201d", "yes"),
])
def test_normalize(raw, expected):
    assert normalize(raw) == expected


def test_numbers_answer_tags_and_completion_text():
    assert numbers_in("x = -5; h2o v1.2 costs $4,200. then 3-4") == ["-5", "$4,200", "3", "4"]
    assert answer_tag("<answer>1</answer> and <ANSWER>\n2\n</ANSWER>") == "\n2\n"
    assert answer_tag("no tag") is None
    # A multi-turn exchange with tool results (GRPO with tools): the answer is the last assistant turn.
    assert completion_text([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "x"},
                            {"role": "assistant", "content": [{"type": "text", "text": "b"}]}]) == "b"
    assert completion_text([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]) == "ab"
    with pytest.raises(TypeError, match="a completion is a string or a list"):
        completion_text(42)


# ------------------------------------------------------------------ exact_match / contains


@pytest.mark.parametrize("shape", ["text", "chat"])
def test_exact_match(shape):
    fn = build("exact_match")
    texts = ["42", "The answer is 4,200.", "<answer> 17 </answer> wait, 18", "<answer>Paris</answer>", "forty-two",
             "I think 41 or 42", "anything"]
    answers = ["42.0", "4200", "17", "paris", "42", "41", None]
    assert run(fn, texts, shape, answer=answers) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, None]


def test_exact_match_tag_wins_over_the_text_outside_it():
    fn = build("exact_match")
    # With a tag, the last number *outside* it does not count; the tag's own last number does.
    assert run(fn, ["<answer>7</answer> so 9", "<answer>it is 9</answer>"], answer=[9, 9]) == [0.0, 1.0]


def test_exact_match_options_and_lists_of_answers():
    fn = build({"exact_match": {"column": "solution", "normalize": False}})
    assert run(fn, ["Paris", "paris", " Paris\n", "4,200"], solution=["Paris", "Paris", "Paris", "4200"]) == \
        [1.0, 0.0, 1.0, 0.0]
    fn = build({"exact_match": "gold"})
    assert run(fn, ["NYC", "x"], gold=[["New York", "nyc"], [None]]) == [1.0, None]
    assert run(fn, ["a"], gold=[""]) == [None]   # an empty reference scores nothing


def test_exact_match_needs_its_column():
    with pytest.raises(ValueError, match="exact_match reads the column 'answer', which was not passed"):
        run(build("exact_match"), ["1"], solution=["1"])


@pytest.mark.parametrize("shape", ["text", "chat"])
def test_contains(shape):
    fn = build("contains")
    texts = ["The capital is PARIS, of course", "It costs $4,200 in total", "1420 apples", "no idea", "x"]
    answers = ["Paris", "4200", "42", "paris", None]
    assert run(fn, texts, shape, answer=answers) == [1.0, 1.0, 0.0, 0.0, None]
    strict = build({"contains": {"normalize": False}})
    assert run(strict, ["The capital is PARIS", "in Paris"], shape, answer=["Paris", "Paris"]) == [0.0, 1.0]


# ------------------------------------------------------------------ regex / format / length


@pytest.mark.parametrize("shape", ["text", "chat"])
def test_regex_anywhere_and_with_column(shape):
    anywhere = build({"regex": r"\\boxed\{"})
    assert run(anywhere, ["so \\boxed{3}", "3"], shape) == [1.0, 0.0]
    captured = build({"regex": {"pattern": r"<answer>(.*?)</answer>", "column": "answer"}})
    texts = ["<answer> 4,200 </answer>", "<answer>\nParis.\n</answer>", "<answer>5</answer>", "5", "<answer>1</answer>"]
    assert run(captured, texts, shape, answer=["4200", "paris", "6", "5", None]) == [1.0, 1.0, 0.0, 0.0, None]
    whole = build({"regex": {"pattern": r"\d+", "column": "answer"}})   # no group: the whole first match
    assert run(whole, ["a 12 b 13", "a 12 b 13"], shape, answer=[12, 13]) == [1.0, 0.0]


@pytest.mark.parametrize("shape", ["text", "chat"])
def test_format_is_a_fullmatch_across_lines(shape):
    fn = build({"format": r"<think>.*?</think>\s*<answer>.*?</answer>"})
    texts = ["<think>a\nb</think>\n<answer>1</answer>\n", "<think>a</think><answer>1</answer> extra",
             "preamble <think>a</think><answer>1</answer>"]
    assert run(fn, texts, shape) == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("shape", ["text", "chat"])
def test_length_in_tokens_and_chars(shape):
    tokens = build({"length": 4})
    ids = [[1] * 4, [1] * 2, [1] * 7, [1] * 9, []]
    completions = ["a"] * 5 if shape == "text" else chat(["a"] * 5)
    assert tokens(prompts=["q"] * 5, completions=completions, completion_ids=ids) == [1.0, 0.5, 0.25, 0.0, 0.0]
    chars = build({"length": {"target": 10, "unit": "chars"}})
    assert run(chars, ["x" * 10, "x" * 8, "x" * 13, "x" * 30], shape) == pytest.approx([1.0, 0.8, 0.7, 0.0])
    with pytest.raises(ValueError, match="counts completion_ids"):
        tokens(prompts=["q"], completions=["a"], completion_ids=None)


def test_builtins_ignore_unrelated_columns():
    fn = build("exact_match")
    assert fn(prompts=["q"], completions=["3"], completion_ids=[[1]], answer=["3"], difficulty=["hard"],
              trainer_state=object()) == [1.0]
