"""How config problems are reported: each an `Issue` named by its dotted config path
(``training.learning_rate``, ``data.datasets.0.path``), pydantic's errors rewritten into that form, and the
data files a config names that are not there. Callers gather them and raise one `ConfigError`, so a
user fixes a broken config in one pass rather than one error per run."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pydantic import ValidationError

from .run import RunConfig


@dataclass(frozen=True)
class Issue:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def _pydantic_issues(exc: ValidationError) -> list[Issue]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if p not in ("function-after",))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check its spelling and section; see docs/config.md)"
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif err["type"].startswith("literal_error"):
            msg = f"{msg}; got {err.get('input')!r}"
        elif "input" in err and not isinstance(err["input"], (dict, list)):
            msg = f"{msg}; got {err['input']!r}"
        msg = msg.removeprefix("Value error, ")
        out.append(Issue(loc, msg))
    return out


def _missing_files(cfg: RunConfig) -> list[Issue]:
    issues = []
    for section in ("datasets", "val_datasets"):
        for i, spec in enumerate(getattr(cfg.data, section)):
            if _looks_local(spec.path) and not cfg.resolve_path(spec.path).exists():
                tried = cfg.resolve_path(spec.path)
                issues.append(Issue(f"data.{section}.{i}.path", f"file not found: {spec.path} (looked at {tried})"))
    return issues


def _looks_local(path: str) -> bool:
    """Hub dataset names look like 'org/name'; files have an extension or a path."""
    suffixes = (".jsonl", ".json", ".csv", ".parquet", ".txt", ".arrow")
    return path.endswith(suffixes) or path.startswith((".", "/", "~")) or os.sep + os.sep in path
