"""Collective backends: a size-1 local one and Horovod (MPI or Gloo).

Everything else in hvdkit talks to a :class:`Backend`, never to Horovod, so a
script runs unchanged with or without a launcher.
"""

from .base import Backend, ReduceOp

__all__ = ["Backend", "ReduceOp", "build_flags", "create"]


def create(name: str, process_sets: list | None = None, dynamic: bool = False) -> Backend:
    """Instantiate the backend called ``name`` ("local" or "horovod").

    ``process_sets``: lists of global ranks to register at start (none equal
    to the whole job); ``dynamic``: allow adding and removing sets later.
    """
    if name == "local":
        from .local import LocalBackend

        return LocalBackend(process_sets, dynamic)
    if name == "horovod":
        from .horovod import HorovodBackend

        return HorovodBackend(process_sets, dynamic)
    from ..errors import ConfigurationError

    raise ConfigurationError(
        f"unknown backend {name!r}; expected 'horovod' (the default under a "
        "launcher) or 'local' (single process, collectives are the identity)."
    )


def build_flags() -> dict[str, int]:
    """What the installed Horovod was built with, whichever backend runs (see horovod.py)."""
    from .horovod import build_flags as flags

    return flags()
