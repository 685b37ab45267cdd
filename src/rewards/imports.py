"""Import a user's reward function from a file or a module, with one clear message for each failure.

A file path resolves against the config's folder first, then the cwd (config.resolve_relative).
The file is imported under a module name of its own (`_mudpuppy_reward_<stem>_<hash of its path>`,
so two files both called rewards.py do not collide) and registered in sys.modules while it runs,
which dataclasses and pickling need. Its folder is on sys.path during the import, so it can import
the modules beside it; import them at the top of the file, since the folder is taken off afterwards.
Every load imports the file afresh, so edits show up in the next run of the same process.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from ..config import resolve_relative
from .errors import RewardFunctionError, first_line, raised_at
from .specs import RewardSpec


def import_function(spec: RewardSpec, source_dir: str | None, modules: dict | None = None,
                    role: str = "reward function") -> Callable:
    """The callable `spec` names. `modules` caches the files imported in one load, keyed by path;
    `role` starts every message (GRPO's tools and environments are imported the same way)."""
    if spec.kind == "file":
        path = _find_file(spec, source_dir, role)
        cache = {} if modules is None else modules
        if path not in cache:
            cache[path] = _import_file(spec, path, role)
        return _get_function(cache[path], spec, f"{spec.target} ({path})", role)
    return _get_function(_import_module(spec, role), spec, f"module {spec.target}", role)


def _find_file(spec: RewardSpec, source_dir: str | None, role: str) -> Path:
    path = resolve_relative(spec.target, source_dir)
    if path.is_file():
        return path.resolve()
    written = Path(os.path.expanduser(spec.target))
    looked = [path] if written.is_absolute() else [Path(d) / written for d in (source_dir, os.getcwd()) if d]
    where = " and ".join(str(p.absolute()) for p in dict.fromkeys(looked))
    raise RewardFunctionError(f"{role} {spec.source}: file not found (looked at {where})")


def _import_file(spec: RewardSpec, path: Path, role: str) -> ModuleType:
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"_mudpuppy_reward_{''.join(c if c.isalnum() else '_' for c in path.stem)}_{digest}"
    importer = importlib.util.spec_from_file_location(name, path)
    if importer is None or importer.loader is None:
        raise RewardFunctionError(f"{role} {spec.source}: {path} cannot be imported as Python")
    module = importlib.util.module_from_spec(importer)
    sys.modules[name] = module
    folder = str(path.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        importer.loader.exec_module(module)
    except (Exception, SystemExit) as exc:   # SystemExit: a script that parses argv at import
        del sys.modules[name]
        raise RewardFunctionError(_failed(spec, spec.target, exc, path.parent, role)) from exc
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
    return module


def _import_module(spec: RewardSpec, role: str) -> ModuleType:
    try:
        return importlib.import_module(spec.target)
    except ModuleNotFoundError as exc:
        if exc.name and (spec.target == exc.name or spec.target.startswith(exc.name + ".")):
            raise RewardFunctionError(
                f"{role} {spec.source}: no module named '{exc.name}' (is it installed, or its folder on "
                f"PYTHONPATH? A function in a file is written 'path/to/file.py:{spec.function}')") from exc
        raise RewardFunctionError(_failed(spec, f"module {spec.target}", exc, None, role)) from exc
    except (Exception, SystemExit) as exc:
        raise RewardFunctionError(_failed(spec, f"module {spec.target}", exc, None, role)) from exc


def _failed(spec: RewardSpec, what: str, exc: BaseException, folder: Path | None, role: str) -> str:
    site = raised_at(exc, folder)
    at = f" at {site}" if site else ""
    return f"{role} {spec.source}: importing {what} failed{at}: {first_line(exc)}"


def _get_function(module: ModuleType, spec: RewardSpec, where: str, role: str) -> Callable:
    fn = getattr(module, spec.function, None)
    if fn is None and not hasattr(module, spec.function):
        defined = defined_callables(module)
        listing = ", ".join(defined) if defined else "none"
        raise RewardFunctionError(f"{role} {spec.source}: {where} has no function '{spec.function}' "
                                  f"(the functions it defines: {listing})")
    if not callable(fn):
        raise RewardFunctionError(f"{role} {spec.source}: '{spec.function}' in {where} is not a function "
                                  f"(its type: {type(fn).__name__})")
    return fn


def defined_callables(module: ModuleType) -> list[str]:
    """Public functions and classes defined in `module` itself (not imported into it), in file order."""
    return [name for name, value in vars(module).items()
            if not name.startswith("_") and callable(value) and inspect.getmodule(value) is module]
