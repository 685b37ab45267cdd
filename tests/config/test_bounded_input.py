"""Bounded config input (issue 37): YAML aliases under an expansion budget, bad values echoed short, and
no float key taking nan or inf. The CLI cases run the real `mudpuppy` in a subprocess: exit code 2, one
message, no traceback, and fast."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml

from mudpuppy.config import MAX_YAML_VALUES
from mudpuppy.configure import load_config
from mudpuppy.errors import ConfigError


def cli(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mudpuppy", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def laughs(levels: int = 9, width: int = 9) -> str:
    """A flow list of nested aliases: `levels` anchors, each repeating the previous one `width` times
    (9 x 9: under 1 KB of YAML that stands for 9^9 = 387 million strings)."""
    parts = ["&a0 [" + ", ".join(['"lol"'] * width) + "]"]
    parts += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


def config_text(tiny_config, key: str, value_yaml: str) -> str:
    """tiny_config as YAML with `section.key` set to raw YAML text (anchors and aliases kept as written)."""
    section, name = key.split(".")
    tiny_config[section][name] = "@VALUE@"
    return yaml.safe_dump(tiny_config).replace("'@VALUE@'", value_yaml)


@pytest.mark.parametrize("key", ["adapter.target_modules", "model.revision", "training.learning_rate"])
def test_an_alias_bomb_in_a_known_key_fails_fast_with_one_short_message(tiny_config, tmp_path, key):
    path = tmp_path / "bomb.yaml"
    path.write_text(config_text(tiny_config, key, laughs()))
    assert path.stat().st_size < 1500
    started = time.monotonic()
    done = cli("validate", path, timeout=60)
    assert time.monotonic() - started < 30
    assert done.returncode == 2, done.stderr
    out = done.stdout + done.stderr
    assert "expand to more than" in out and "Traceback" not in out
    assert "lol" not in out and len(out) < 1000, out          # the expanded value is never printed


def test_the_expansion_is_refused_before_anything_is_built(tiny_config, tmp_path):
    """2^30 values behind 30 anchors: refused from the node graph in well under a second of work (a
    subprocess, so that a regression is killed by the timeout rather than filling this process)."""
    path = tmp_path / "bomb.yaml"
    path.write_text(config_text(tiny_config, "adapter.target_modules", laughs(levels=30, width=2)))
    done = cli("validate", path, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "1 problem in the config" in done.stdout + done.stderr
    assert f"expand to more than {MAX_YAML_VALUES:,} values" in done.stdout + done.stderr


def test_an_alias_inside_its_own_block_is_one_message(tiny_config, tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text(config_text(tiny_config, "adapter.target_modules", "&loop [q_proj, *loop]"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [info.value.problems[0]] and "refers to the block that contains it" in str(info.value)


def test_nesting_past_the_interpreter_stack_is_one_message(tiny_config, tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text(config_text(tiny_config, "model.revision", "[" * 5000 + "]" * 5000))
    done = cli("validate", path)
    assert done.returncode == 2 and "nested too deeply" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_ordinary_anchors_aliases_and_merge_keys_still_load(tiny_config, tmp_path):
    """The budget counts expanded values; a config that shares a block a few times is far below it."""
    train, val = (spec["path"] for spec in tiny_config["data"]["datasets"] + tiny_config["data"]["val_datasets"])
    tiny_config["data"]["datasets"] = "@TRAIN@"
    tiny_config["data"]["val_datasets"] = "@VAL@"
    tiny_config["adapter"]["target_modules"] = "@MODS@"
    text = (yaml.safe_dump(tiny_config)
            .replace("'@TRAIN@'", f"[&spec {{path: {train}, num_samples: 64, system_prompt: be brief}}]")
            .replace("'@VAL@'", f"[{{<<: *spec, path: {val}, num_samples: 16}}]")
            .replace("'@MODS@'", "&mods [q_proj, v_proj]"))
    path = tmp_path / "anchors.yaml"
    path.write_text(text)
    cfg = load_config(path)
    assert cfg.data.val_datasets[0].system_prompt == "be brief" and cfg.data.val_datasets[0].num_samples == 16
    assert cfg.adapter.target_modules == ["q_proj", "v_proj"]


def test_a_long_bad_value_is_echoed_cut_short(tiny_config, tmp_path):
    tiny_config["backend"] = "x" * 200_000
    tiny_config["model"]["revision"] = ["y" * 100_000] * 1000
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(tiny_config))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert "backend:" in text and "model.revision:" in text
    assert len(text) < 1500, text


def test_a_wrong_long_list_is_reported_in_a_bounded_number_of_lines(tiny_config, tmp_path):
    tiny_config["adapter"]["target_modules"] = list(range(10_000))
    path = tmp_path / "many.yaml"
    path.write_text(yaml.safe_dump(tiny_config))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.problems) <= 51
    assert "more problems" in info.value.problems[-1]


# --------------------------------------------------------------------------- non-finite floats

NON_FINITE = [".inf", "-.inf", ".nan", ".Inf", ".NaN"]


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("key", ["training.learning_rate", "training.max_grad_norm", "training.weight_decay",
                                 "training.warmup_ratio", "data.val_set_size"])
def test_every_float_key_refuses_nan_and_inf_naming_its_path(tiny_config, tmp_path, key, value):
    path = tmp_path / "cfg.yaml"
    path.write_text(config_text(tiny_config, key, value))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert any(p.startswith(f"{key}: must be a finite number") for p in info.value.problems), info.value.problems


def test_floats_inside_lists_and_nested_sections_refuse_them_too(tiny_config, tmp_path):
    tiny_config["data"]["datasets"][0]["weight"] = float("inf")
    tiny_config["method"] = "grpo"
    tiny_config["data"]["packing"] = False
    tiny_config["grpo"] = {"reward_funcs": ["exact_match", "exact_match"], "reward_weights": [1.0, float("nan")]}
    with pytest.raises(ConfigError) as info:
        load_config(tiny_config)
    problems = "\n".join(info.value.problems)
    assert "data.datasets.0.weight: must be a finite number" in problems
    assert "grpo.reward_weights.1: must be a finite number" in problems


def test_an_override_of_inf_is_refused(tiny_config, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_config))
    with pytest.raises(ConfigError) as info:
        load_config(path, ["training.learning_rate=inf"])
    assert info.value.problems == ["training.learning_rate: must be a finite number, not nan or inf; got 'inf'"]


@pytest.mark.parametrize("verb", [("validate",), ("run", "--config")])
def test_validate_and_run_refuse_an_infinite_learning_rate_before_training(tiny_config, tmp_path, verb):
    path = tmp_path / "cfg.yaml"
    path.write_text(config_text(tiny_config, "training.learning_rate", ".inf"))
    done = cli(*verb, path)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "training.learning_rate: must be a finite number" in out and "Traceback" not in out
    assert not (tmp_path / "run").exists()            # nothing trained, no adapter reported "finished"
