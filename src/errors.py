"""User-facing errors: each ends a CLI run with one clear message and exit code 2.

Anything that is *not* one of these is a bug in mudpuppy and keeps its traceback.
"""

from __future__ import annotations


class MudpuppyError(Exception):
    """A problem the user can fix: bad config, bad data, missing model or backend."""

    exit_code = 2


class ConfigError(MudpuppyError):
    def __init__(self, origin: str, problems: list[str]):
        self.origin = origin
        self.problems = list(problems)
        count = len(self.problems)
        head = f"{origin}: {count} problem{'s' if count != 1 else ''} in the config"
        super().__init__(head + "\n" + "\n".join(f"  - {p}" for p in self.problems))


class DataError(MudpuppyError):
    """Bad data, named by file and line (or row) number."""

    def __init__(self, file: str, line: int | None, message: str):
        self.file, self.line, self.detail = file, line, message
        where = f"{file}:{line}" if line is not None else file
        super().__init__(f"{where}: {message}")


class BackendUnavailable(MudpuppyError):
    pass


class ModelNotFound(MudpuppyError):
    pass


class OutputExists(MudpuppyError):
    pass


class OutOfDeviceMemory(MudpuppyError):
    """A training step ran out of device memory; the message says what to change. The training
    loop adds where the newest complete checkpoint is."""

    exit_code = 4
