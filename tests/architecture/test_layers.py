"""DESIGN.md's layering rule, checked from the code's own imports (Python's `ast`, function-level imports
included: an import hidden inside a function is still an import).

- `import torch` / `mlx` / `mlx_lm` / `torchao` belongs under `src/backends/`;
- `backends/` imports nothing above it (training, evaluation, monitor, serving, export, cli, shortcuts,
  launch);
- no source file is over 500 lines (issue 27: one job per file);
- the import graph has no cycle. A package's `__init__` is left out as a target: `from . import x`
  re-exports would otherwise make every package a cycle with its own modules.

KNOWN lists violations accepted for now, each with the reason; it has been empty since issue 27 moved the
last runtime import under backends/. The test fails on a violation not in the list and on a listed one that
no longer occurs, so the list can only shrink.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = "mudpuppy"
RUNTIMES = ("torch", "mlx", "mlx_lm", "torchao")
ABOVE_BACKENDS = ("training", "evaluation", "monitor", "serving", "export", "cli", "shortcuts", "launch")

KNOWN: dict[str, str] = {}       # empty since issue 27: any violation fails


@dataclass
class Layers:
    modules: dict[str, Path] = field(default_factory=dict)       # dotted name -> file
    edges: dict[str, set[str]] = field(default_factory=dict)     # module -> modules of this package it imports
    runtimes: dict[str, set[str]] = field(default_factory=dict)  # module -> runtime libraries it imports


def module_name(src: Path, path: Path) -> str:
    rel = ".".join(path.relative_to(src).with_suffix("").parts)
    if rel == "__init__":
        return PKG
    return f"{PKG}.{rel.removesuffix('.__init__')}"


def resolve(layers: Layers, module: str, node: ast.ImportFrom) -> str | None:
    """The absolute name a `from ... import` names (before its imported names)."""
    if not node.level:
        return node.module
    parts = module.split(".")
    base = parts if layers.modules[module].name == "__init__.py" else parts[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imported_names(layers: Layers, module: str, tree: ast.AST):
    for node in ast.walk(tree):                        # every level: module, class and function bodies
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = resolve(layers, module, node)
            if target:
                yield target
                yield from (f"{target}.{alias.name}" for alias in node.names)


def scan(src: Path) -> Layers:
    layers = Layers()
    for folder, _, names in os.walk(src):
        for name in names:
            if name.endswith(".py"):
                path = Path(folder) / name
                layers.modules[module_name(src, path)] = path
    for module, path in layers.modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for target in imported_names(layers, module, tree):
            top = target.split(".")[0]
            if top in RUNTIMES:
                layers.runtimes.setdefault(module, set()).add(top)
            if top == PKG:
                while target not in layers.modules and "." in target:    # `from pkg import function`
                    target = target.rsplit(".", 1)[0]
                if target in layers.modules and target != module:
                    layers.edges.setdefault(module, set()).add(target)
    return layers


def cycles(layers: Layers) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph = {m: sorted(t for t in ts if layers.modules[t].name != "__init__.py") for m, ts in layers.edges.items()}
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in sorted(layers.modules):
        if root in index:
            continue
        work = [(root, iter(graph.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def violations(layers: Layers) -> set[str]:
    out = set()
    backends = f"{PKG}.backends"
    for module, libs in layers.runtimes.items():
        if module != backends and not module.startswith(backends + "."):
            out |= {f"runtime: {module} imports {lib}" for lib in libs}
    for module, targets in layers.edges.items():
        if module == backends or module.startswith(backends + "."):
            out |= {f"upward: {module} -> {t.split('.')[1]}" for t in targets
                    if t.count(".") and t.split(".")[1] in ABOVE_BACKENDS}
    for component in cycles(layers):
        out.add("cycle: " + " <-> ".join(m.removeprefix(PKG + ".") for m in component))
    return out


@pytest.fixture(scope="module")
def found() -> set[str]:
    return violations(scan(SRC))


def test_no_new_layering_violation(found):
    new = sorted(found - set(KNOWN))
    assert not new, ("the layering of DESIGN.md is broken (fix it, or see tests/architecture/test_layers.py):\n  "
                     + "\n  ".join(new))


def test_every_known_violation_still_occurs(found):
    gone = sorted(set(KNOWN) - found)
    assert not gone, "fixed: remove from KNOWN in tests/architecture/test_layers.py:\n  " + "\n  ".join(gone)


MAX_LINES = 500          # issue 27: a file past this does more than one job; split it by job


def test_no_source_file_is_over_500_lines():
    long = sorted(f"{path.relative_to(SRC)}: {n} lines" for path in SRC.rglob("*.py")
                  if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES)
    assert not long, f"over {MAX_LINES} lines (split by job):\n  " + "\n  ".join(long)


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_finds_a_planted_cycle_torch_import_and_upward_import(tmp_path):
    src = write_tree(tmp_path / "src", {
        "__init__.py": "from .a import f\n",
        "a.py": "def f():\n    from .b import g\n    return g\n",              # a function-level import
        "b.py": "from . import c\n",
        "c.py": "from .a import f\n",                                        # a -> b -> c -> a
        "training/__init__.py": "",
        "training/loop.py": "import numpy\n\ndef step():\n    import torch.nn as nn\n",
        "backends/__init__.py": "",
        "backends/leaf.py": "import torch\nimport mlx.core as mx\n",       # allowed here
        "backends/up.py": "from ..training import loop\n",
    })
    layers = scan(src)
    assert violations(layers) == {
        "cycle: a <-> b <-> c",
        "runtime: mudpuppy.training.loop imports torch",
        "upward: mudpuppy.backends.up -> training",
    }


def test_package_reexports_and_absolute_imports_are_followed(tmp_path):
    src = write_tree(tmp_path / "src", {
        "__init__.py": "",
        "monitor/__init__.py": "from .live import show\n",
        "monitor/live.py": "from mudpuppy.monitor.dashboard import draw\n\ndef show():\n    pass\n",
        "monitor/dashboard.py": "def draw():\n    from mudpuppy.monitor.live import show\n",
        "serving/__init__.py": "",
        "serving/server.py": "from mudpuppy.monitor import show\nfrom mlx_lm import load\n",
    })
    assert violations(scan(src)) == {"cycle: monitor.dashboard <-> monitor.live",
                                     "runtime: mudpuppy.serving.server imports mlx_lm"}
