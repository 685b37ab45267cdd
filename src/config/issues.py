"""How config problems are reported: each an `Issue` named by its dotted config path
(``training.learning_rate``, ``data.datasets.0.path``), pydantic's errors rewritten into that form, and the
data files a config names that are not there. Callers gather them and raise one `ConfigError`, so a
user fixes a broken config in one pass rather than one error per run."""

from __future__ import annotations

import os
import reprlib
from dataclasses import dataclass

from pydantic import ValidationError

from .run import RunConfig

# A bad value is echoed so the user sees what was read, never whole: a 1 MB string, or a list that
# aliases made huge, would bury the message (and building its full repr can take minutes).
ECHO_CHARS = 80
MESSAGE_CHARS = 600
MAX_ISSUES = 50                  # then one line saying how many more: a wrong 100,000-item list is one mistake
_ECHO = reprlib.Repr()          # keyword arguments to Repr() need Python 3.12
_ECHO.maxstring = _ECHO.maxother = ECHO_CHARS
_ECHO.maxlist = _ECHO.maxtuple = _ECHO.maxdict = _ECHO.maxset = 4
_ECHO.maxlevel, _ECHO.maxlong = 2, 40


def short_repr(value) -> str:
    """repr(value), bounded: built piecewise by reprlib (never the whole repr first), then cut."""
    return shorten(_ECHO.repr(value), ECHO_CHARS)


def shorten(text: str, limit: int = MESSAGE_CHARS) -> str:
    """`text` cut to `limit` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit:,} more characters)"


@dataclass(frozen=True)
class Issue:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def _pydantic_issues(exc: ValidationError) -> list[Issue]:
    out = []
    errors = exc.errors()
    for err in errors[:MAX_ISSUES]:
        loc = ".".join(str(p) for p in err["loc"] if p not in ("function-after",))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check its spelling and section; see docs/config.md)"
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif err["type"] == "finite_number":
            msg = f"must be a finite number, not nan or inf; got {short_repr(err.get('input'))}"
        elif err["type"].startswith("literal_error"):
            msg = f"{msg}; got {short_repr(err.get('input'))}"
        elif "input" in err and not isinstance(err["input"], (dict, list)):
            msg = f"{msg}; got {short_repr(err['input'])}"
        msg = shorten(msg.removeprefix("Value error, "))
        out.append(Issue(shorten(loc, 200), msg))
    if len(errors) > MAX_ISSUES:
        out.append(Issue("", f"... and {len(errors) - MAX_ISSUES:,} more problems (fix these first)"))
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
