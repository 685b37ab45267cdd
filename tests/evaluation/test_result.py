"""The one held-out result every method returns (evaluation/result.py): run_summary.json keeps each method
family's layout of eval_before / eval_after, a resumed run reads it back unchanged, and the lines a run
prints are the ones it printed before the three result types became one."""

from __future__ import annotations

import json

import pytest

from mudpuppy.evaluation import EvalResult, ObjectiveEval, loss_table

EXAMPLES = [{"reference": "on", "prediction": "on", "match": True}]
MODEL = EvalResult(loss=1.25, perplexity=3.4903, exact_match=0.5, samples=8, examples=EXAMPLES)
OBJECTIVE = EvalResult(loss=0.6931, accuracy=0.625, accuracy_name="reward_accuracy",
                       metrics={"reward_accuracy": 0.625, "reward_margin": 0.0123}, samples=16)
SCORES = EvalResult(loss=0.5, accuracy=None, accuracy_name="accuracy", metrics={"mse": 0.5}, samples=3)
REWARD = EvalResult(reward=0.123456789, rewards={"exact_match": 0.5, "length": 0.2500004}, samples=4)


@pytest.mark.parametrize("result, layout", [
    (MODEL, {"loss": 1.25, "perplexity": 3.4903, "exact_match": 0.5, "samples": 8, "examples": EXAMPLES}),
    (EvalResult(loss=2.0, samples=2), {"loss": 2.0, "samples": 2}),
    (OBJECTIVE, {"loss": 0.6931, "accuracy": 0.625, "accuracy_name": "reward_accuracy",
                 "metrics": {"reward_accuracy": 0.625, "reward_margin": 0.0123}, "samples": 16}),
    (SCORES, {"loss": 0.5, "accuracy": None, "accuracy_name": "accuracy", "metrics": {"mse": 0.5}, "samples": 3}),
    (REWARD, {"eval_reward": 0.123457, "eval_rewards/exact_match/mean": 0.5, "eval_rewards/length/mean": 0.25}),
])
def test_each_family_keeps_its_summary_layout_and_reads_back_through_json(result, layout):
    written = result.as_dict()
    assert written == layout and list(written) == list(layout)          # key order: run_summary.json's
    again = EvalResult.from_dict(json.loads(json.dumps(written)))       # a checkpoint's loop state
    assert again.as_dict() == layout
    assert again.describe(count=False) == EvalResult.from_dict(layout).describe(count=False)


def test_the_lines_a_run_prints():
    assert MODEL.describe() == "held-out loss 1.2500, exact match 50.0% (8 examples)"
    assert EvalResult(exact_match=0.25, samples=4).describe() == "exact match 25.0% (4 examples)"
    assert OBJECTIVE.describe() == "held-out loss 0.6931, reward_accuracy 62.5% (16 examples)"
    assert SCORES.describe() == "held-out loss 0.5000 (3 examples)"
    assert REWARD.describe() == "held-out reward 0.1235 (greedy, 4 prompts)"
    assert REWARD.describe(count=False) == "held-out reward 0.1235"


def test_what_the_loop_watches_and_logs():
    assert EvalResult(loss=1.23456789, samples=2).for_loop() == (1.23456789, {"eval_loss": 1.234568})
    assert OBJECTIVE.for_loop() == (0.6931, {"eval_loss": 0.6931, "eval_reward_accuracy": 0.625,
                                             "eval_reward_margin": 0.0123})
    value, fields = REWARD.for_loop()                  # lower is better: the reward negated, unrounded
    assert value == -0.123456789 and fields == REWARD.as_dict()


def test_the_old_names_still_import_and_gptqs_loss_table():
    assert ObjectiveEval is EvalResult
    rows = [("original", EvalResult(loss=2.0)), ("round-to-nearest", EvalResult(loss=2.5)),
            ("GPTQ", EvalResult(loss=2.125))]
    assert loss_table(rows).splitlines() == ["held-out loss      loss     vs original",
                                             "  original         2.0000  +0.0000",
                                             "  round-to-nearest 2.5000  +0.5000",
                                             "  GPTQ             2.1250  +0.1250"]
