"""grpo.reward_funcs parsing: every form, every malformed form named by its entry, weights, names, config."""

from __future__ import annotations

import pytest
from mudpuppy.config import RunConfig
from mudpuppy.configure import load_config
from mudpuppy.errors import ConfigError
from mudpuppy.rewards import BUILTINS, RewardSpec, parse_reward_specs
from mudpuppy.rewards.options import BUILTIN_OPTIONS


def parse_one(item) -> RewardSpec:
    (spec,) = parse_reward_specs([item], None)
    return spec


def error(items, weights=None) -> str:
    with pytest.raises(ValueError) as info:
        parse_reward_specs(items, weights)
    return str(info.value)


def test_builtin_table_and_option_table_agree():
    assert set(BUILTINS) == set(BUILTIN_OPTIONS) == {"exact_match", "contains", "regex", "format", "length"}


def test_bare_builtins_take_their_defaults():
    spec = parse_one("exact_match")
    assert (spec.kind, spec.name, spec.target, spec.function) == ("builtin", "exact_match", "exact_match", None)
    assert spec.options == (("column", "answer"), ("normalize", True)) and spec.weight == 1.0
    assert parse_one("contains").options == (("column", "answer"), ("normalize", True))


@pytest.mark.parametrize("item, options", [
    ({"exact_match": "solution"}, (("column", "solution"), ("normalize", True))),
    ({"exact_match": {"column": "gold", "normalize": False}}, (("column", "gold"), ("normalize", False))),
    ({"exact_match": None}, (("column", "answer"), ("normalize", True))),
    ({"contains": "solution"}, (("column", "solution"), ("normalize", True))),
    ({"regex": "<answer>"}, (("column", None), ("pattern", "<answer>"))),
    ({"regex": {"pattern": "=(\\d+)", "column": "answer"}}, (("column", "answer"), ("pattern", "=(\\d+)"))),
    ({"format": "<think>.*</think>.*"}, (("pattern", "<think>.*</think>.*"),)),
    ({"format": {"pattern": "a+"}}, (("pattern", "a+"),)),
    ({"length": 200}, (("target", 200), ("unit", "tokens"))),
    ({"length": {"target": 50, "unit": "chars"}}, (("target", 50), ("unit", "chars"))),
])
def test_builtin_options_mapping_and_shorthand(item, options):
    spec = parse_one(item)
    assert spec.kind == "builtin" and spec.target == next(iter(item))
    assert spec.options == options
    hash(spec)   # frozen and hashable, options included


def test_file_and_module_strings():
    spec = parse_one("rewards/format.py:has_answer_tag")
    assert (spec.kind, spec.name, spec.target, spec.function) == ("file", "has_answer_tag", "rewards/format.py",
                                                                   "has_answer_tag")
    spec = parse_one("mypkg.rewards:length_penalty")
    assert (spec.kind, spec.name, spec.target, spec.function) == ("module", "length_penalty", "mypkg.rewards",
                                                                   "length_penalty")
    assert parse_one("/abs/dir with space/r.py:f").target == "/abs/dir with space/r.py"
    assert parse_one("single:f").kind == "module"


def test_function_mapping_and_reward_model():
    spec = parse_one({"function": "r.py:check", "name": "checker"})
    assert (spec.kind, spec.name, spec.target, spec.function) == ("file", "checker", "r.py", "check")
    assert parse_one({"function": "pkg.mod:f"}).kind == "module"
    spec = parse_one({"reward_model": "outputs/rm"})
    assert (spec.kind, spec.name, spec.target, spec.options) == ("reward_model", "reward_model", "outputs/rm",
                                                                  (("batch_size", 16),))
    spec = parse_one({"reward_model": "outputs/rm", "batch_size": 4, "name": "helpful"})
    assert spec.name == "helpful" and spec.option("batch_size") == 4


def test_name_overrides_and_duplicates_are_numbered_in_order():
    specs = parse_reward_specs(["exact_match", {"exact_match": "b"}, {"contains": "a", "name": "hit"},
                                "exact_match", "r.py:f", "other.py:f", {"reward_model": "rm"}], None)
    assert [s.name for s in specs] == ["exact_match", "exact_match_2", "hit", "exact_match_3", "f", "f_2",
                                       "reward_model"]
    specs = parse_reward_specs(["exact_match", {"contains": "x", "name": "exact_match_2"}, "exact_match"], None)
    assert [s.name for s in specs] == ["exact_match", "exact_match_2", "exact_match_3"]


def test_weights():
    specs = parse_reward_specs(["exact_match", "contains"], [2, -0.5])
    assert [s.weight for s in specs] == [2.0, -0.5]
    assert all(isinstance(s.weight, float) for s in specs)
    msg = error(["exact_match", "contains", {"length": 9}], [1.0, 2.0])
    assert msg.startswith("reward_weights: 2 weights for 3 reward_funcs")
    assert "reward_weights[1]: expected a finite number, got nan" in error(["exact_match", "contains"],
                                                                           [1.0, float("nan")])
    assert "reward_weights[0]" in error(["exact_match"], [True])
    assert "reward_weights[0]" in error(["exact_match"], [float("inf")])


@pytest.mark.parametrize("item, expected", [
    ("format", "format needs a pattern, for example {format:"),
    ("regex", "regex needs a pattern, for example"),
    ("length", "length needs a target"),
    ("exact-match", "unknown reward function 'exact-match' (did you mean exact_match?)"),
    ("nonsense", "a function in a file ('path/to/file.py:function')"),
    ("rewards.py", "'rewards.py' names a file but no function in it"),
    ("rewards.py:1bad", "after the ':' comes the function's name"),
    ({"regex": "(["}, "regex.pattern: not a valid regular expression"),
    ({"format": {"pattern": "a)"}}, "format.pattern: not a valid regular expression"),
    ({"length": 0}, "length.target: expected a whole number above 0, got 0"),
    ({"length": True}, "length.target: expected a whole number above 0, got True"),
    ({"length": {"target": 5, "unit": "words"}}, "length.unit: expected 'tokens' or 'chars', got 'words'"),
    ({"exact_match": {"colum": "x"}}, "exact_match: unknown option 'colum' (its options: column, normalize)"),
    ({"exact_match": {"normalize": "yes"}}, "exact_match.normalize: expected true or false"),
    ({"exact_match": ["a", "b"]}, "exact_match.column: expected a column name"),
    ({"contains": ""}, "contains.column: expected a column name"),
    ({}, "an empty mapping"),
    ({"exactmatch": {}}, "unknown key 'exactmatch' (did you mean exact_match?)"),
    ({"exact_match": None, "contains": None}, "one built-in per entry"),
    ({"exact_match": None, "name": "a b"}, "name: expected letters, digits"),
    ({"exact_match": None, "name": "a/b"}, "rewards/<name>/mean"),
    ({"reward_model": ""}, "reward_model: expected the path of a model trained with method: rm"),
    ({"reward_model": "rm", "batch_size": 0}, "batch_size: expected a whole number above 0"),
    ({"reward_model": "rm", "column": "x"}, "unknown key 'column' beside reward_model"),
    ({"function": "exact_match"}, "function: expected 'path/to/file.py:function' or 'package.module:function'"),
    ({"function": "r.py:f", "weight": 2}, "unknown key 'weight' beside function"),
    (3, "expected a name or a mapping, got int"),
])
def test_malformed_entries_are_named_by_index(item, expected):
    msg = error(["exact_match", item])
    assert msg.startswith("reward_funcs[1]: "), msg
    assert expected in msg, msg


def test_every_problem_reported_at_once_joined_with_semicolons():
    msg = error(["format", "exact_match", {"length": -1}, "bogus"], [1.0])
    parts = msg.split("; reward_")
    assert msg.startswith("reward_funcs[0]: format needs a pattern")
    assert "reward_funcs[2]: length.target" in msg and "reward_funcs[3]: unknown reward function 'bogus'" in msg
    assert "reward_weights: 1 weight for 4 reward_funcs" in msg
    assert len(parts) == 4


def test_empty_list_rejected():
    assert error([]).startswith("reward_funcs: expected a list of one or more")


# ------------------------------------------------------------------ through the config


def grpo_config(reward_funcs, **grpo) -> dict:
    return {"model": {"base_model": "x"}, "method": "grpo", "data": {"datasets": [{"path": "p.jsonl"}]},
            "output_dir": "o", "training": {"micro_batch_size": 8},
            "grpo": {"reward_funcs": reward_funcs, **grpo}}


def test_config_accepts_a_minimal_grpo_section():
    cfg = RunConfig.model_validate(grpo_config(["exact_match", "rewards/f.py:score", {"length": 100}],
                                               reward_weights=[1.0, 0.5, 0.1]))
    assert cfg.grpo.reward_funcs[2] == {"length": 100}
    specs = parse_reward_specs(cfg.grpo.reward_funcs, cfg.grpo.reward_weights)
    assert [s.name for s in specs] == ["exact_match", "score", "length"]


def test_config_rejects_a_bad_reward_spec_naming_the_entry():
    with pytest.raises(ConfigError) as info:
        load_config(grpo_config(["exact_match", {"format": None}]), check_files=False)
    (problem,) = info.value.problems
    assert problem.startswith("grpo: reward_funcs[1]: format needs a pattern"), problem


def test_config_rejects_mismatched_weights():
    with pytest.raises(ConfigError) as info:
        load_config(grpo_config(["exact_match"], reward_weights=[1.0, 2.0]), check_files=False)
    assert any("reward_weights: 2 weights for 1 reward_funcs" in p for p in info.value.problems)
