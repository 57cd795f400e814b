"""Threads that run one task after another, a new one started only when none is idle.

Python's threaded servers (``socketserver.ThreadingMixIn``) start a thread per
connection, and Horovod's HTTP store opens a connection per request: the 19,000
requests of a world of 1,000 ranks started 19,000 threads, each start a hand-over
of the GIL between the accepting thread and the new one (a fifth of the
rendezvous server's CPU samples, benchmarks/rendezvous.py). :class:`ReusedThreads`
keeps a finished thread waiting for the next task for ``idle_s`` seconds, so a
burst starts about as many threads as run at once. There is no bound here: the
caller bounds what runs at once (the guard's connection cap and mesh waits).

Example::

    >>> import threading
    >>> done, lock = [], threading.Lock()
    >>> def task(i):
    ...     with lock:
    ...         done.append(i)
    >>> threads = ReusedThreads(task, idle_s=0.5, name="example")
    >>> for i in range(3):
    ...     threads.submit(i)
    >>> threads.stop(join_s=10)  # waits for the tasks submitted
    >>> sorted(done), threads.started <= 3
    ([0, 1, 2], True)
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

_STOP = object()


class ReusedThreads:
    """Run ``task(*args)`` of each :meth:`submit` on an idle thread, or on a new one.

    Args:
        task: what each thread runs for each submitted ``args``; its exceptions are
            the task's to handle (an escaping one ends that thread only).
        idle_s: how long a thread waits for a next task before it ends.
        name: the threads' name.
    """

    def __init__(self, task: Callable[..., None], idle_s: float, name: str):
        self._task, self._idle_s, self._name = task, idle_s, name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        # threads waiting for a task, less the tasks queued: >= 0, and a thread that
        # stops waiting may end only while it is > 0 (no queued task is left without one)
        self._idle = 0
        self._threads: set[threading.Thread] = set()
        self.started = 0  # threads started in all

    def submit(self, *args) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
            self._tasks.put(args)
            if start:
                thread = threading.Thread(
                    target=self._run, name=f"{self._name}-{self.started}", daemon=True
                )
                self._threads.add(thread)
                self.started += 1
        if start:
            thread.start()

    def stop(self, join_s: float = 0.0) -> None:
        """End every thread once the tasks submitted before are done: the idle ones now.

        Waits up to ``join_s`` for each thread (0: does not wait).
        """
        with self._lock:
            threads = list(self._threads)
            for _ in threads:
                self._tasks.put(_STOP)
        for thread in threads:
            if join_s > 0:
                thread.join(join_s)

    def _run(self) -> None:
        try:
            while True:
                try:
                    args = self._tasks.get(timeout=self._idle_s)
                except queue.Empty:
                    with self._lock:
                        if self._idle == 0:  # a task is on its way for this thread
                            continue
                        self._idle -= 1
                        return
                if args is _STOP:
                    return
                self._task(*args)
                with self._lock:
                    self._idle += 1
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
