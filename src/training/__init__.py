"""Training methods, each one recipe written against the backend protocol."""

from .sft import RunResult, run_sft

__all__ = ["RunResult", "run_sft", "run"]


def run(cfg, backend=None, overwrite: bool = False, echo=print) -> RunResult:
    """Run the method a config names on `backend` (created from the config when omitted)."""
    from ..backends import create_backend

    backend = backend or create_backend(cfg.backend, **cfg.backend_options())
    methods = {"sft": run_sft}
    return methods[cfg.method](cfg, backend, overwrite=overwrite, echo=echo)
