"""Per-rank console output and log files for launched jobs.

Horovod's launchers tag each line with its rank: ``[1]<stdout>:text`` under
Gloo and ``[1,1]<stdout>:text`` under Open MPI. We untag it, print it as
``[rank 1] text``, append it to ``<log_dir>/rank.1/stdout`` and keep the last
lines of every rank for failure reports.

Open MPI tags every *write*, not every line, and does not end a write that
lacks a newline: when a rank prints its text and its newline in two writes
(unbuffered Python does), another rank's write can land between them, and one
line of mpirun's output reads
``[1,1]<stdout>:text of 1[1,0]<stdout>:text of 0`` followed later by
``[1,1]<stdout>:`` (rank 1's newline). So each tagged piece is added to its
own rank's unfinished line, and a line is complete when its rank's newline
arrives.
"""

from __future__ import annotations

import collections
import re
import sys
import threading
from pathlib import Path
from typing import IO

# A rank's tag: [rank]<stream>: (Gloo) or [jobid,rank]<stream>: (Open MPI).
TAG = re.compile(r"\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:")
TAIL_LINES = 20


class RankOutput:
    """Routes rank lines to the console, log files and tail buffers (thread-safe)."""

    def __init__(self, log_dir: str | Path | None = None, prefix: bool = True):
        self.log_dir = Path(log_dir) if log_dir else None
        self.prefix = prefix
        self.tails: dict[int, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES)
        )
        self.launcher_lines: collections.deque = collections.deque(maxlen=200)
        self._files: dict[tuple[int, str], IO[str]] = {}
        # (rank, stream) -> pieces of a line whose newline has not arrived yet
        self._unfinished: dict[tuple[int, str], list[str]] = {}
        self._lock = threading.Lock()

    def _file(self, rank: int, stream: str) -> IO[str] | None:
        if self.log_dir is None:
            return None
        key = (rank, stream)
        if key not in self._files:
            path = self.log_dir / f"rank.{rank}" / stream
            path.parent.mkdir(parents=True, exist_ok=True)
            self._files[key] = open(path, "a", buffering=1)
        return self._files[key]

    def rank_line(self, rank: int, stream: str, text: str) -> None:
        with self._lock:
            self.tails[rank].append(text)
            f = self._file(rank, stream)
            if f is not None:
                f.write(text + "\n")
            out = sys.stderr if stream == "stderr" else sys.stdout
            out.write(f"[rank {rank}] {text}\n" if self.prefix else text + "\n")
            out.flush()

    def launcher_line(self, text: str, stream: str = "stderr") -> None:
        with self._lock:
            self.launcher_lines.append(text)
            out = sys.stderr if stream == "stderr" else sys.stdout
            out.write(text + "\n")
            out.flush()

    def feed(self, line: str, default_stream: str) -> None:
        """One line of a Horovod launcher's output (see the module docstring).

        Example: ``feed("[1,1]<stdout>:b[1,0]<stdout>:a\\n", "stdout")`` prints
        rank 0's line ``a`` and keeps ``b`` until rank 1's newline arrives.
        """
        ended = line.endswith("\n")
        before, *tagged = TAG.split(line.rstrip("\n"))  # before, rank, stream, text, rank, ...
        if before.strip() or not tagged:
            self.launcher_line(before, default_stream)
        if not tagged:
            return
        keys = [(int(rank), stream) for rank, stream in zip(tagged[::3], tagged[1::3], strict=True)]
        with self._lock:
            for key, text in zip(keys, tagged[2::3], strict=True):
                self._unfinished.setdefault(key, []).append(text)
        if ended:  # the newline is the last piece's
            self._finish(keys[-1])

    def _finish(self, key: tuple[int, str]) -> None:
        with self._lock:
            pieces = self._unfinished.pop(key, None)
        if pieces is not None:
            self.rank_line(key[0], key[1], "".join(pieces))

    def finish_lines(self, stream: str | None = None) -> None:
        """Print the ranks' unfinished lines (of ``stream``, or all): their output ended."""
        with self._lock:
            keys = [k for k in self._unfinished if stream is None or k[1] == stream]
        for key in sorted(keys):
            self._finish(key)

    def pump(self, pipe: IO[str], default_stream: str, rank: int | None = None) -> threading.Thread:
        """Read ``pipe`` to its end on a thread.

        With ``rank`` every line is that rank's (a worker's own program);
        without, lines are a Horovod launcher's, tagged with their rank.
        """

        def loop():
            for line in pipe:
                if rank is None:
                    self.feed(line, default_stream)
                else:
                    self.rank_line(rank, default_stream, line.rstrip("\n"))
            if rank is None:
                self.finish_lines(default_stream)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        return t

    def tail(self, rank: int, n: int = 10) -> list[str]:
        with self._lock:
            return list(self.tails.get(rank, ()))[-n:]

    def tails_by_rank(self, n: int = TAIL_LINES) -> dict[int, list[str]]:
        """The last ``n`` lines of every rank that printed any."""
        with self._lock:
            return {r: list(t)[-n:] for r, t in self.tails.items()}

    def reset_tails(self) -> None:
        """Forget the ranks' last lines and the launcher's lines (a new attempt begins)."""
        with self._lock:
            self.tails.clear()
            self.launcher_lines.clear()
            self._unfinished.clear()

    def close(self) -> None:
        self.finish_lines()
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
