"""docs/architecture.md draws the house as it is: every `file.py: function` it names exists, the step it
says is in six files is, and each function it names as a whole step holds every part of it in its own body
(issue 39: a reader once opened 17 files to follow one SFT step, and the loop body took 13 arguments)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
# `training/loop.py: train_loop`, `backends/torch/trainer.py: TorchTrainer.step`
NAMED = re.compile(r"`([\w/]+\.py): ([\w.]+)`")
SIX = re.compile(r"is in six files: (.*?)\(the same six", re.S)

# What each function that holds a whole step must call itself, not through a helper it calls.
STEP_PARTS = {
    ("training/loop.py", "train_loop"): ["learning_rate", "next_batch", "step", "on_step_end", "on_log",
                                         "check_patience", "save"],
    ("backends/torch/trainer.py", "TorchTrainer.step"): ["_forward", "backward", "clip_grad_norm_", "step",
                                                         "zero_grad"],
    ("backends/mlx/trainer.py", "MlxTrainer.step"): ["_value_and_grad", "global_norm", "clip_by_norm", "update"],
}


def definition(path: Path, name: str) -> ast.AST | None:
    """The function or class `name` (or `Class.method`) defined in `path`, or None."""
    scope: list[ast.stmt] = ast.parse(path.read_text(encoding="utf-8")).body
    found = None
    for part in name.split("."):
        found = next((node for node in scope if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                      and node.name == part), None)
        if found is None:
            return None
        scope = found.body
    return found


def missing_names(text: str, src: Path) -> list[str]:
    return [f"{file}: {name}" for file, name in NAMED.findall(text)
            if not (src / file).is_file() or definition(src / file, name) is None]


def called(node: ast.AST) -> set[str]:
    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            func = call.func
            names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return names


def test_every_file_and_function_the_architecture_names_exists():
    text = DOC.read_text(encoding="utf-8")
    assert len(NAMED.findall(text)) >= 15           # the hops are named, not only described
    missing = missing_names(text, ROOT / "src")
    assert not missing, "docs/architecture.md names what is not there:\n" + "\n".join(missing)


def test_the_checker_sees_a_name_that_is_gone(tmp_path):
    (tmp_path / "loop.py").write_text("def train_loop():\n    pass\n\nclass Run:\n    def result(self):\n        pass\n")
    text = "`loop.py: train_loop` `loop.py: Run.result` `loop.py: _run_steps` `loop.py: Run.create_trainer` " \
           "`gone.py: f`"
    assert missing_names(text, tmp_path) == ["loop.py: _run_steps", "loop.py: Run.create_trainer", "gone.py: f"]


def test_the_step_is_in_the_six_files_the_architecture_lists():
    listed = re.findall(r"`([\w/]+\.py)`", SIX.search(DOC.read_text(encoding="utf-8")).group(1))
    assert len(listed) == 6 and all((ROOT / "src" / path).is_file() for path in listed), listed
    for (path, _), parts in STEP_PARTS.items():
        if "/mlx/" not in path:
            assert path in listed


def test_each_step_is_written_out_in_one_function():
    for (path, name), parts in STEP_PARTS.items():
        node = definition(ROOT / "src" / path, name)
        assert node is not None, f"{path}: {name}"
        absent = [part for part in parts if part not in called(node)]
        assert not absent, f"{path}: {name} no longer calls {absent} itself"
        args = node.args
        assert len(args.args) + len(args.kwonlyargs) <= 10, f"{path}: {name} takes too many arguments"
