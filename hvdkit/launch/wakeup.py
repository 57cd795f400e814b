"""A wait another thread can end early: a pipe a selector (or ``select``) waits on."""

from __future__ import annotations

import contextlib
import os


class Wakeup:
    """Set from any thread to end a wait on it at once; :meth:`clear` once woken.

    Waited on by :func:`~hvdkit.launch.processes.supervise` (besides the child)
    and by :class:`~hvdkit.launch.listening.Listener` (besides its channels).

    >>> wake = Wakeup()
    >>> wake.set()          # from any thread, as often as wanted; never blocks
    >>> wake.close()
    """

    def __init__(self):
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def set(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closed
            os.write(self._w, b"!")

    def fileno(self) -> int:
        return self._r

    def clear(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self._r, 512):
                pass

    def close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)
