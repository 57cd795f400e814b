"""hvdkit's exception hierarchy.

Every error hvdkit raises on purpose derives from :class:`HvdkitError` and
from the builtin it refines (``ValueError``, ``RuntimeError``, ...), so that
``except ValueError`` in existing code keeps working. Messages name the bad
value, what was expected, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "HvdkitError",
    "NotInitializedError",
    "CollectiveError",
    "CollectiveMismatchError",
    "ConfigurationError",
    "ShardingError",
    "DataFormatError",
    "LaunchError",
    "InputPipelineError",
    "NotSupportedError",
]


class HvdkitError(Exception):
    """Base class of all errors raised by hvdkit itself."""


class NotInitializedError(HvdkitError, RuntimeError):
    """An hvdkit function that needs the runtime was called before ``hvdkit.init()``."""

    def __init__(
        self,
        message: str = "hvdkit is not initialized: call hvdkit.init() at the top of your "
        "script, before any other hvdkit function.",
    ):
        super().__init__(message)


class CollectiveError(HvdkitError, RuntimeError):
    """A collective operation failed (peer lost, transport error, ...)."""


class CollectiveMismatchError(CollectiveError, ValueError):
    """Ranks called the same collective with incompatible shapes, dtypes or patterns.

    What the collectives raise is also a ``tf.errors.FailedPreconditionError``,
    the class Horovod raises for the same mistake, so Horovod code that catches
    that class keeps working (see :mod:`hvdkit.collectives`; this module does
    not import TensorFlow, so that the launcher starts without it).
    """


class ConfigurationError(HvdkitError, ValueError):
    """An argument or setting is invalid, or two settings conflict."""


class NotSupportedError(HvdkitError, NotImplementedError):
    """A combination Horovod also refuses with ``NotImplementedError``.

    For example ``allreduce`` of a ``tf.IndexedSlices`` with ``op=Min``.
    """


class ShardingError(HvdkitError, ValueError):
    """Dataset sharding arguments are invalid for the data they apply to."""


class DataFormatError(HvdkitError, ValueError):
    """A data file is missing, truncated, or not in the expected format."""


class LaunchError(HvdkitError, RuntimeError):
    """Starting, rendezvous or supervision of a multi-process job failed."""


class InputPipelineError(HvdkitError, RuntimeError):
    """The input pipeline (a bad record, a failing map function) failed during a sink.

    Raised by :mod:`hvdkit.sink` in place of TensorFlow's error, which is
    chained as ``__cause__`` and quoted in the message. ``step`` is the
    0-based index of the training step whose batch could not be produced.
    """

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step
