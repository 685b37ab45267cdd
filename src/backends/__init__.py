"""Runtimes live here and only here: torch (cpu, cuda, rocm) and mlx."""

from .factory import backend_names, create_backend, probe, probe_all
from .protocol import Availability, BackendProtocol

__all__ = ["backend_names", "create_backend", "probe", "probe_all", "Availability", "BackendProtocol"]
