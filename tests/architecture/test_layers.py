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


# ---------------------------------------------------------------- writes to what other packages own
#
# Issue 39: no side effect outside a scope. A module under src/ may not write another package's private
# attributes (`transformers.X._mapping[k] = v`, `setattr(torch._C, "_x", ...)`, `X._table.update(...)`,
# also through a local name bound to one), nor the process environment (`os.environ[k] = v`, setdefault,
# pop, update, del, putenv, also through a name bound to os.environ), except where ALLOWED_WRITES says why.
# Like KNOWN, the list can only shrink: an entry that no longer occurs fails too.

ALLOWED_WRITES: dict[str, str] = {
    "environ: mudpuppy.cli": "the CLI owns its process: quiets transformers / huggingface_hub / tokenizers before "
                             "they are imported (they read these once), for the command's whole life",
    "environ: mudpuppy.launch": "`run --nproc`'s parent sets what the copies it starts inherit (OMP_NUM_THREADS, "
                                "MUDPUPPY_LAUNCHER); it runs no training itself",
    "environ: mudpuppy.data.workers": "scoped_env: TOKENIZERS_PARALLELISM for the tokenizing pool, restored after it "
                                      "however it ends (monitor/trackers.py uses it for MLflow's start)",
    "environ: mudpuppy.backends.factory": "CUBLAS_WORKSPACE_CONFIG for training.deterministic on a GPU backend only: "
                                          "cuBLAS reads it at its first call and torch re-checks it at every call "
                                          "while its process-wide deterministic switch is on; removed again when "
                                          "no GPU backend came of it",
    "environ: mudpuppy.backends.torch.devices.gpu": "the GPU allocator's defaults (PYTORCH_*_ALLOC_CONF), read once by "
                                                "torch before its first device allocation; a user's value is kept",
    "environ: mudpuppy.backends.torch.devices.visibility": "which GPUs HIP may see (HIP/ROCR_VISIBLE_DEVICES), read once when "
                                                   "HIP starts; hiding an iGPU that would crash the run",
}

MUTATORS = {"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__", "append", "extend",
            "insert", "remove", "add", "discard"}


def foreign_names(tree: ast.AST) -> set[str]:
    """Names a module binds to another package's modules and objects (the standard library's included)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] != PKG}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] != PKG:
            names |= {a.asname or a.name for a in node.names}
    return names


def chain(node: ast.AST) -> tuple[str | None, list[str]]:
    """The root name of `a.b[c].d` and the attributes on the way ('b', 'd')."""
    attrs = []
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Attribute):
            attrs.append(node.attr)
        node = node.func if isinstance(node, ast.Call) else node.value
    return (node.id if isinstance(node, ast.Name) else None), attrs[::-1]


def private(attr: str) -> bool:
    return attr.startswith("_") and not attr.endswith("__")


class Writes(ast.NodeVisitor):
    """What one module writes of other packages' state; `found` holds 'environ: M' and 'private: M: code'."""

    def __init__(self, module: str, foreign: set[str]):
        self.module, self.foreign, self.found = module, foreign, set()
        self.environ_aliases, self.private_aliases = set(), set()

    def is_environ(self, node: ast.AST) -> bool:
        root, attrs = chain(node)
        if isinstance(node, ast.Name):
            return node.id in self.environ_aliases or (node.id == "environ" and "environ" in self.foreign)
        return root == "os" and "os" in self.foreign and attrs == ["environ"]

    def is_private(self, node: ast.AST) -> bool:
        root, attrs = chain(node)
        return (root in self.foreign and any(map(private, attrs))) or (root in self.private_aliases)

    def names_environ(self, node: ast.AST) -> bool:
        """`node` evaluates to os.environ itself (`os.environ if e is None else e` included), not a copy."""
        if isinstance(node, ast.IfExp):
            return self.names_environ(node.body) or self.names_environ(node.orelse)
        if isinstance(node, ast.BoolOp):
            return any(map(self.names_environ, node.values))
        return isinstance(node, (ast.Attribute, ast.Name)) and self.is_environ(node)

    def visit_FunctionDef(self, node):
        saved = set(self.environ_aliases), set(self.private_aliases)
        self.generic_visit(node)
        self.environ_aliases, self.private_aliases = saved

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node):
        for target in node.targets:
            self.written(target)
            if isinstance(target, ast.Name):           # a local name for os.environ or a private attribute
                if self.names_environ(node.value):
                    self.environ_aliases.add(target.id)
                if isinstance(node.value, ast.Attribute) and self.is_private(node.value):
                    self.private_aliases.add(target.id)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self.written(node.target)
        self.generic_visit(node)

    visit_AnnAssign = visit_AugAssign

    def visit_Delete(self, node):
        for target in node.targets:
            self.written(target)
        self.generic_visit(node)

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
            self.written(func.value, mutated=True)
        elif isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and private(name.value):
                root, _ = chain(node.args[0])
                if root in self.foreign:
                    self.found.add(f"private: {self.module}: {ast.unparse(node)}")
        elif isinstance(func, ast.Attribute) and func.attr in ("putenv", "unsetenv") and chain(func)[0] == "os":
            self.found.add(f"environ: {self.module}")
        self.generic_visit(node)

    def written(self, target: ast.AST, mutated: bool = False) -> None:
        """`target` is assigned or deleted, or (`mutated`) changed in place by a method call."""
        if self.is_environ(target.value if isinstance(target, ast.Subscript) else target) if (
                mutated or isinstance(target, ast.Subscript)) else self.is_environ(target):
            self.found.add(f"environ: {self.module}")
        elif (mutated or isinstance(target, (ast.Attribute, ast.Subscript))) and self.is_private(target):
            self.found.add(f"private: {self.module}: {ast.unparse(target)}")


def global_writes(src: Path) -> set[str]:
    found = set()
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        visitor = Writes(module_name(src, path), foreign_names(tree))
        visitor.visit(tree)
        found |= visitor.found
    return found


@pytest.fixture(scope="module")
def writes() -> set[str]:
    return global_writes(SRC)


def test_no_module_writes_other_packages_private_state_or_the_environment(writes):
    new = sorted(writes - set(ALLOWED_WRITES))
    assert not new, ("a write outside mudpuppy's own state (scope it, or allow it with its reason in "
                     "tests/architecture/test_layers.py ALLOWED_WRITES):\n  " + "\n  ".join(new))


def test_every_allowed_write_still_occurs(writes):
    gone = sorted(set(ALLOWED_WRITES) - writes)
    assert not gone, "no longer written: remove from ALLOWED_WRITES:\n  " + "\n  ".join(gone)


def test_the_checker_finds_planted_private_and_environment_writes(tmp_path):
    src = write_tree(tmp_path / "src", {
        "__init__.py": "",
        "table.py": "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS\n\n"
                    "def install(f):\n    local = ALL_ATTENTION_FUNCTIONS._local_mapping\n    local['sdpa'] = f\n",
        "direct.py": "import torch\n\ntorch._dynamo.config.x = 1\nsetattr(torch, '_hidden', 2)\n",
        "mutate.py": "import logging\n\nlogging._handlers.clear()\n",
        "env.py": "import os\n\ndef f(environ=None):\n    environ = os.environ if environ is None else environ\n"
                  "    environ['A'] = '1'\n",
        "env2.py": "from os import environ\n\nenviron.setdefault('B', '2')\n",
        "env3.py": "import os\n\ndel os.environ['C']\n",
        "fine.py": "import os\nimport torch\n\nclass Mine:\n    _cache = {}\n\n"
                   "def g(env):\n    env = dict(os.environ)\n    env['A'] = '1'\n    Mine._cache['k'] = 1\n"
                   "    value = torch._C\n    torch.backends.cudnn.benchmark = False\n    return os.environ.get('X')\n",
    })
    assert global_writes(src) == {
        "private: mudpuppy.table: local['sdpa']",
        "private: mudpuppy.direct: torch._dynamo.config.x",
        "private: mudpuppy.direct: setattr(torch, '_hidden', 2)",
        "private: mudpuppy.mutate: logging._handlers",
        "environ: mudpuppy.env", "environ: mudpuppy.env2", "environ: mudpuppy.env3",
    }
