"""Loading user reward functions (files, modules, reward models), the column check, and scoring."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest
from mudpuppy.errors import MudpuppyError
from mudpuppy.rewards import (
    RewardFunction,
    RewardFunctionError,
    check_columns,
    load_reward_functions,
    parse_reward_specs,
    score,
)


def write(path, source: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def load(items, source_dir=None, **kwargs):
    return load_reward_functions(parse_reward_specs(items, None), None if source_dir is None else str(source_dir),
                                 **kwargs)


def failure(items, source_dir=None, **kwargs) -> str:
    with pytest.raises(RewardFunctionError) as info:
        load(items, source_dir, **kwargs)
    return str(info.value)


@pytest.fixture()
def config_dir(tmp_path, monkeypatch):
    """A config folder with a rewards/ subfolder; the cwd elsewhere, so only source_dir can find the files."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return tmp_path / "cfg"


# ------------------------------------------------------------------ loading


def test_user_file_relative_to_the_config_folder_imports_its_siblings(config_dir):
    write(config_dir / "rewards" / "helpers.py", "BONUS = 0.5\n")
    write(config_dir / "rewards" / "fmt.py", """
        from helpers import BONUS

        def has_answer_tag(prompts, completions, completion_ids, **kwargs):
            return [1.0 + BONUS if "<answer>" in c else 0.0 for c in completions]

        def other(**kwargs):
            return []
    """)
    funcs = load(["rewards/fmt.py:has_answer_tag", "exact_match", {"function": "rewards/fmt.py:other", "name": "o"}],
                 config_dir)
    assert [f.name for f in funcs] == ["has_answer_tag", "exact_match", "o"]
    assert isinstance(funcs[0], RewardFunction) and funcs[0].spec.kind == "file"
    assert funcs[0](["q", "q"], ["<answer>1</answer>", "no"], [[1], [2]]) == [1.5, 0.0]
    assert str(config_dir / "rewards") not in __import__("sys").path   # taken off after the import


def test_user_file_falls_back_to_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "r.py", "def f(completions, **kw):\n    return [0.25] * len(completions)\n")
    (func,) = load(["r.py:f"], tmp_path / "elsewhere")
    assert func(prompts=["p"], completions=["c"], completion_ids=[[1]]) == [0.25]


def test_module_on_sys_path(tmp_path, monkeypatch):
    write(tmp_path / "mypkg_rw" / "__init__.py", "")
    write(tmp_path / "mypkg_rw" / "rewards.py", """
        def length_penalty(completions, completion_ids, **kwargs):
            return [-len(ids) / 10 for ids in completion_ids]
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    (func,) = load(["mypkg_rw.rewards:length_penalty"])
    assert func.spec.kind == "module" and func.name == "length_penalty"
    assert func(["p", "p"], ["a", "b"], [[1, 2], [1, 2, 3, 4, 5]]) == [-0.2, -0.5]


def test_missing_file_says_where_it_looked(config_dir):
    msg = failure(["rewards/nope.py:f"], config_dir)
    assert "reward function rewards/nope.py:f: file not found" in msg
    looked = f"looked at {config_dir / 'rewards' / 'nope.py'} and {config_dir.parent / 'cwd' / 'rewards' / 'nope.py'}"
    assert looked in msg, msg


def test_file_that_raises_at_import_names_file_line_and_error(config_dir):
    write(config_dir / "broken.py", "import math\n\nVALUE = 1 / 0\n\ndef f(**kw):\n    return []\n")
    msg = failure(["broken.py:f"], config_dir)
    assert msg.startswith("reward function broken.py:f: importing broken.py failed at ")
    assert f"{config_dir.resolve() / 'broken.py'}:3" in msg and "ZeroDivisionError: division by zero" in msg


def test_file_with_a_syntax_error(config_dir):
    write(config_dir / "syntax.py", "def f(:\n    pass\n")
    msg = failure(["syntax.py:f"], config_dir)
    assert "syntax.py:1" in msg and "SyntaxError" in msg


def test_missing_function_lists_what_the_file_defines(config_dir):
    write(config_dir / "r.py", """
        import os
        from math import sqrt

        def accuracy(**kw):
            return []

        class Judge:
            pass

        def _private(**kw):
            return []
    """)
    msg = failure(["r.py:acuracy"], config_dir)
    assert "has no function 'acuracy' (the functions it defines: accuracy, Judge)" in msg


def test_not_callable(config_dir):
    write(config_dir / "r.py", "THRESHOLD = 3\n")
    assert "'THRESHOLD' in r.py" in failure(["r.py:THRESHOLD"], config_dir)
    assert "is not a function (its type: int)" in failure(["r.py:THRESHOLD"], config_dir)


def test_missing_module_and_broken_module(tmp_path, monkeypatch):
    assert "no module named 'no_such_pkg_xyz'" in failure(["no_such_pkg_xyz.rewards:f"])
    write(tmp_path / "badmod_rw.py", "import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    msg = failure(["badmod_rw:f"])
    assert "importing module badmod_rw failed at" in msg and "badmod_rw.py:1" in msg
    assert "ModuleNotFoundError: No module named 'no_such_dependency_xyz'" in msg


def test_every_failing_spec_reported_together(config_dir):
    msg = failure(["a.py:f", "exact_match", "b.py:g"], config_dir)
    assert "a.py:f: file not found" in msg and "b.py:g: file not found" in msg


def test_reward_models_go_through_the_factory():
    assert "needs a backend" in failure([{"reward_model": "outputs/rm"}])
    seen = []

    def factory(spec):
        seen.append(spec)
        return lambda prompts, completions, completion_ids, **kw: [0.5] * len(completions)

    (func,) = load([{"reward_model": "outputs/rm", "batch_size": 2}], reward_model=factory)
    assert seen[0].target == "outputs/rm" and seen[0].option("batch_size") == 2
    assert func.name == "reward_model" and func(["p"], ["c"], [[1]]) == [0.5]


# ------------------------------------------------------------------ columns


def test_check_columns_names_function_column_and_what_is_there():
    funcs = load(["exact_match", {"contains": "solution"}, {"regex": "x"}, {"length": 3}])
    check_columns(funcs, {"prompt", "answer", "solution"}, "data.datasets")
    with pytest.raises(RewardFunctionError) as info:
        check_columns(funcs, {"prompt", "solution"}, "data.datasets (train.jsonl)")
    msg = str(info.value)
    assert msg.startswith("data.datasets (train.jsonl): reward function exact_match reads column 'answer'")
    assert "(its columns: prompt, solution)" in msg and "contains" not in msg.split("which")[0]


# ------------------------------------------------------------------ scoring


def scored(fn, n=3, **columns):
    func = RewardFunction(parse_reward_specs(["r.py:custom"], None)[0], fn)
    return score([func], ["p"] * n, ["c"] * n, [[1]] * n, columns)


def test_score_matrix_weights_untouched_and_none_as_nan():
    funcs = load(["exact_match", {"length": {"target": 2, "unit": "chars"}}])
    rewards = score(funcs, ["p"] * 3, ["7", "seven", "x"], [[1], [2], [3]],
                    {"answer": ["7", "7", None], "prompt": ["p"] * 3})
    assert rewards.dtype == np.float64 and rewards.shape == (3, 2)
    np.testing.assert_array_equal(rewards[:, 0], [1.0, 0.0, np.nan])
    np.testing.assert_allclose(rewards[:, 1], [0.5, 0.0, 0.5])


def test_score_accepts_arrays_tuples_bools_numpy_and_nan():
    assert scored(lambda **kw: np.array([1, 2, 3])).ravel().tolist() == [1.0, 2.0, 3.0]
    out = scored(lambda **kw: (True, np.float32(0.5), float("nan"))).ravel()
    assert out[0] == 1.0 and out[1] == 0.5 and math.isnan(out[2])


def test_score_passes_columns_by_name():
    got = scored(lambda completions, difficulty, **kw: [float(d) for d in difficulty], difficulty=[1, 2, 3])
    assert got.ravel().tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("fn, expected", [
    (lambda **kw: [1.0, 2.0], "reward function custom returned 2 values for 3 completions"),
    (lambda **kw: 1.0, "reward function custom returned a float; it must return a list"),
    (lambda **kw: np.zeros((3, 1)), "returned a ndarray of shape (3, 1)"),
    (lambda **kw: [1.0, "high", 0.0], "reward function custom returned 'high' (str) at index 1"),
    (lambda **kw: [1.0, 0.0, float("inf")], "returned inf (float) at index 2"),
])
def test_score_rejects_bad_returns(fn, expected):
    with pytest.raises(RewardFunctionError) as info:
        scored(fn)
    assert expected in str(info.value)


def test_score_wraps_an_exception_inside_the_function(config_dir):
    write(config_dir / "r.py", "def oops(completions, **kw):\n    return [1 / 0 for c in completions]\n")
    funcs = load(["r.py:oops"], config_dir)
    with pytest.raises(MudpuppyError) as info:
        score(funcs, ["p"], ["c"], [[1]], {})
    msg = str(info.value)
    assert msg.startswith("reward function oops raised at ") and "r.py:2" in msg
    assert msg.endswith("ZeroDivisionError: division by zero")
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_a_reward_model_folder_with_an_unreadable_config_yaml_is_one_message(tmp_path):
    # The folder is the user's (reward_model: DIR): its config.yaml is read under the alias budget and a bad
    # one is a MudpuppyError naming the folder, not a YAML traceback or minutes of alias expansion.
    from mudpuppy.errors import MudpuppyError
    from mudpuppy.training.reward_models import RewardModelFunction

    (tmp_path / "config.json").write_text("{}")
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join('*' + chr(97 + i) for _ in range(10))}]\n" for i in range(7))
    for text in (bomb + "data: {sequence_len: 64}\n", "data: [unclosed\n"):
        (tmp_path / "config.yaml").write_text(text)
        with pytest.raises(MudpuppyError, match="config.yaml cannot be read"):
            RewardModelFunction(backend=None, path=tmp_path, batch_size=1).load()
