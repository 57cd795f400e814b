"""Rank 0 writes a checkpoint in a thread while training goes on: :class:`BackgroundWriter`.

:meth:`hvdkit.Checkpointer.save` copies the variables into buffers kept from
the last save (:meth:`BackgroundWriter.snapshot`: training changes the
variables as soon as ``save`` returns) and hands the write to one thread
(:meth:`~BackgroundWriter.start`). One write runs at a time: the next save,
a restore, :meth:`hvdkit.Checkpointer.wait`, a preemption stop and the
process's end (the thread is not a daemon) wait for it, and a failed write is
raised at the next of these (:meth:`~BackgroundWriter.wait`).

Example:
    >>> writer = BackgroundWriter(Path("ckpt"))
    >>> arrays = writer.snapshot(variables)           # copies, reused next time
    >>> writer.start(step, lambda: write(arrays))     # returns at once
    >>> writer.wait()                                 # on disk, or the failure raised
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from .. import _compat
from ..errors import HvdkitError
from . import _checkpoint_files as files

__all__ = ["BackgroundWriter"]

# The write in progress per checkpoint directory (this process), so that a
# Checkpointer restoring from a directory waits for another one writing there.
_writing: dict[Path, threading.Thread] = {}


class BackgroundWriter:
    """One thread at a time writing ``directory``'s checkpoints (rank 0 only).

    Args:
        directory: The checkpoints' folder (``None``: nothing is ever written).
    """

    def __init__(self, directory: Path | None):
        self.directory = directory
        self._thread: threading.Thread | None = None
        self._error: tuple[Path, BaseException] | None = None
        self._buffers: list = []  # the last snapshot's arrays, reused by the next

    def snapshot(self, variables: list) -> list:
        """Copies of ``variables``' values (NumPy arrays), in buffers kept from the last call."""
        buffers = self._buffers + [None] * (len(variables) - len(self._buffers))
        self._buffers = [
            _compat.copy_variable(v, out) for v, out in zip(variables, buffers, strict=False)
        ]
        return self._buffers

    def start(self, step: int, write: Callable[[], None]) -> None:
        """Run ``write`` (which writes checkpoint ``step``) in a thread; :meth:`wait` first."""
        self._thread = threading.Thread(
            target=self._run,
            args=(files.final_folder(self.directory, step), write),
            name=f"hvdkit-checkpoint-{step}",
            daemon=False,  # the interpreter waits for it at exit: the last save is kept
        )
        self._thread.start()
        _writing[self.directory.resolve()] = self._thread

    def _run(self, folder: Path, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as e:  # raised on the training thread at the next wait()
            self._error = (folder, e)

    def wait(self) -> None:
        """Block until the write (if any) is on disk.

        Raises:
            HvdkitError: the write failed; names the checkpoint and the cause.
        """
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        if self._error is not None:
            folder, cause = self._error
            self._error = None
            raise HvdkitError(
                f"writing checkpoint {folder.name} in the background failed: "
                f"{type(cause).__name__}: {cause}. The earlier checkpoints are intact; check "
                f"that {self.directory} is writable and has space."
            ) from cause

    def wait_for_others(self) -> None:
        """Block until another writer of this process into the same directory finished."""
        other = self.directory and _writing.get(self.directory.resolve())
        if other is not None:
            other.join()
