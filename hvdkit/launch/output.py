"""Per-rank console output and log files for launched jobs.

Horovod's launchers tag each line with its rank: ``[1]<stdout>:text`` under
Gloo and ``[1,1]<stdout>:text`` under Open MPI. We untag it, print it as
``[rank 1] text``, append it to ``<log_dir>/rank.1/stdout`` and keep the last
lines of every rank for failure reports.
"""

from __future__ import annotations

import collections
import re
import sys
import threading
from pathlib import Path
from typing import IO

TAGGED = re.compile(r"^\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:(.*)$")
# Open MPI tags every write, so one print can carry tags in the middle too.
INNER_TAG = re.compile(r"\[(?:\d+,)?\d+\]<(?:stdout|stderr)>:")
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
        """One line of a Horovod launcher's output."""
        line = line.rstrip("\n")
        m = TAGGED.match(line)
        if m:
            self.rank_line(int(m.group(1)), m.group(2), INNER_TAG.sub("", m.group(3)))
        else:
            self.launcher_line(line, default_stream)

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

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
