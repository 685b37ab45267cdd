"""Config validation: every problem reported at once, with its path; overrides. (`mudpuppy validate`'s exit
codes: tests/cli/test_verbs.py.)"""

from __future__ import annotations

import pytest
import yaml

from mudpuppy.config import apply_override
from mudpuppy.configure import load_config
from mudpuppy.errors import ConfigError

from ..conftest import REPO


def write(tmp_path, data, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_quickstart_config_validates():
    cfg = load_config(REPO / "configs" / "quickstart.yaml")
    assert cfg.model.base_model == "smollm2-135m-instruct"
    assert cfg.adapter.type == "lora" and cfg.adapter.target_modules == "all-linear"
    assert cfg.resolve_path(cfg.data.datasets[0].path).is_file()


def test_every_problem_is_reported_at_once_with_its_path(tiny_config, tmp_path):
    tiny_config["training"]["learning_rate"] = -1
    tiny_config["training"]["micro_batch_size"] = "eight"
    tiny_config["adapter"]["rank"] = 8                 # unknown key (it is `r`)
    tiny_config["colour"] = "blue"                     # unknown top-level key
    tiny_config["backend"] = "tpu"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, tiny_config))
    problems = "\n".join(info.value.problems)
    assert len(info.value.problems) == 5, problems
    for path in ("training.learning_rate", "training.micro_batch_size", "adapter.rank", "colour", "backend"):
        assert f"{path}:" in problems
    assert "greater than 0" in problems
    assert "unknown key" in problems


def test_missing_dataset_file_named_with_path(tiny_config, tmp_path):
    tiny_config["data"]["datasets"].append({"path": "nowhere/missing.jsonl"})
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, tiny_config))
    assert any(p.startswith("data.datasets.1.path: file not found: nowhere/missing.jsonl") for p in info.value.problems)


def test_required_sections_missing():
    with pytest.raises(ConfigError) as info:
        load_config({"backend": "cpu"})
    problems = "\n".join(info.value.problems)
    for key in ("model", "data", "output_dir"):
        assert f"{key}: required key is missing" in problems


def test_yaml_syntax_error_names_line(tmp_path):
    path = write(tmp_path, "model:\n  base_model: x\ndata: [unclosed\n")
    with pytest.raises(ConfigError, match="line 4"):
        load_config(path)


def test_yaml_is_loaded_safely(tmp_path):
    path = write(tmp_path, "model: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_overrides_are_typed_and_reach_lists(tiny_config, tmp_path):
    path = write(tmp_path, tiny_config)
    cfg = load_config(path, ["training.max_steps=3", "training.learning_rate=1e-4",
                             "data.datasets.0.num_samples=5", "adapter.target_modules=[q_proj,v_proj]"])
    assert cfg.training.max_steps == 3 and cfg.training.learning_rate == 1e-4
    assert cfg.data.datasets[0].num_samples == 5
    assert cfg.adapter.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize("item, message", [
    ("training.max_steps", "expected KEY=VALUE"),
    ("data.datasets.7.path=x.jsonl", "out of range"),
    ("output_dir.sub=1", "is a value, not a section"),
])
def test_bad_overrides_are_named(item, message):
    raw = {"output_dir": "o", "data": {"datasets": [{"path": "a.jsonl"}]}}
    with pytest.raises(ValueError, match=message):
        apply_override(raw, item)


def test_relative_data_paths_resolve_beside_the_config(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text('{"text": "hi"}\n')
    path = write(tmp_path, {"model": {"base_model": "m"}, "data": {"datasets": [{"path": "d/train.jsonl"}]},
                            "output_dir": "out"})
    cfg = load_config(path)
    assert cfg.resolve_path("d/train.jsonl") == tmp_path / "d" / "train.jsonl"


def test_epochs_default_and_warmup_conflict():
    base = {"model": {"base_model": "m"}, "data": {"datasets": [{"path": "org/name"}]}, "output_dir": "o"}
    assert load_config(base).training.epochs == 1.0
    with pytest.raises(ConfigError, match="warmup_steps or warmup_ratio"):
        load_config({**base, "training": {"warmup_steps": 3, "warmup_ratio": 0.1}})


def test_checks_above_the_schema_report_in_its_order_with_their_paths():
    """The chat template and reward spec checks need data/ and rewards/; they run inside validation (the
    check step's context), so they come in the same list as the schema's problems, where today's did."""
    base = {"model": {"base_model": "m"}, "data": {"datasets": [{"path": "org/name"}]}, "output_dir": "o"}
    cfg = {**base, "method": "grpo", "grpo": {"reward_funcs": ["zzz"]}, "training": {"learning_rate": 0},
           "data": {**base["data"], "chat_template": "nope"}}
    with pytest.raises(ConfigError) as info:
        load_config(cfg, check_files=False)
    problems = info.value.problems
    assert [p.split(":")[0] for p in problems] == ["data.chat_template", "training.learning_rate", "grpo"], problems
    assert problems[0].startswith("data.chat_template: unknown chat template 'nope'; use 'tokenizer', one of chatml")
    assert problems[2].startswith("grpo: reward_funcs[0]: unknown reward function 'zzz'")
    tools = {**base, "method": "grpo", "grpo": {"reward_funcs": [], "tools": ["calculator"]}}
    with pytest.raises(ConfigError) as info:       # the tools check comes first and alone, as before
        load_config(tools, check_files=False)
    assert info.value.problems == ["grpo: tools[0]: 'calculator' is not 'path/to/file.py:function' or "
                                   "'package.module:function'"]


def test_the_config_package_imports_nothing_above_it():
    """config/ is the schema: mudpuppy.errors is the only other part of mudpuppy it may import."""
    import ast

    package = REPO / "src" / "config"
    above = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level > 1 and node.module != "errors":
                above.append(f"{path.name}: from {'.' * node.level}{node.module or ''} import ...")
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and "mudpuppy" in ast.unparse(node):
                above.append(f"{path.name}: {ast.unparse(node)}")
    assert not above, above


@pytest.mark.parametrize("adapter, memory, held", [
    ("qlora", {}, "adapter.type: qlora keeps them as 4-bit codes"),
    ("lora", {"stream_layers": True}, "memory.stream_layers keeps them in host memory"),
])
def test_fp8_with_frozen_base_layers_is_refused_by_the_config(tiny_config, tmp_path, adapter, memory, held):
    """torchao's float8 swap cannot take QLoRA's 4-bit or streamed layers: refused before any backend starts."""
    tiny_config["training"]["precision"] = "fp8"
    tiny_config["adapter"]["type"] = adapter
    tiny_config["memory"] = memory
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, tiny_config))
    assert any(p.startswith("training.precision: fp8 runs the base's linear layers") and held in p
               for p in info.value.problems), info.value.problems
    tiny_config["adapter"]["type"], tiny_config["memory"] = "lora", {}
    assert load_config(write(tmp_path, tiny_config)).training.precision == "fp8"
