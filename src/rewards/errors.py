"""The error a reward function ends a run with, and where in the user's code an exception came from."""

from __future__ import annotations

import traceback
from pathlib import Path

from ..errors import MudpuppyError

_HERE = Path(__file__).resolve().parent


class RewardFunctionError(MudpuppyError):
    """A reward function could not be found, imported, called, or returned something unusable."""


def first_line(exc: BaseException) -> str:
    """`TypeName: first line of the message`: enough to recognise the error in a one-line report."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def raised_at(exc: BaseException, prefer: Path | None = None) -> str | None:
    """`file:line` where `exc` came from, or None.

    Users need the line in *their* code, not in importlib or in mudpuppy: so frames of the import
    machinery and of this package are skipped, frames under `prefer` (the user file's folder) win,
    and otherwise the innermost remaining frame is named.
    """
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f"{exc.filename}:{exc.lineno}"   # the failing file never ran, so it has no frame
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<") and _HERE not in Path(f.filename).resolve().parents]
    if prefer is not None:
        mine = [f for f in frames if prefer in Path(f.filename).resolve().parents and "site-packages" not in f.filename]
        frames = mine or frames
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None
