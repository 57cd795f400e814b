"""Per-rank console output and log files for launched jobs: a relay that never stops.

Horovod's launchers tag each piece of a rank's output with its rank:
``[1]<stdout>:text`` under Gloo and ``[1,1]<stdout>:text`` under Open MPI. We
untag it, print it as ``[rank 1] text``, append it to
``<log_dir>/rank.1/stdout`` and keep the last lines of every rank for failure
reports. A worker of the scheduler/worker launch reads its own rank's pipes
directly, untagged, through the same line machinery.

What the relay promises (it is a console, not a line parser):

* it reads bytes and never stops draining a pipe: bytes that are not UTF-8
  become U+FFFD, a character split across two reads is joined, and an error
  while routing a piece is reported once per pipe and the relay goes on;
* a line of any length arrives: past :data:`MAX_PIECE` characters it is
  printed in pieces of that size (the log file gets it whole);
* a carriage return (Keras's progress bar) updates the rank's line on the
  console in place instead of starting a new tagged line; the log file and the
  failure tails get the line as it last read when its newline came.

Open MPI tags every *write*, not every line, and does not end a write that
lacks a newline: when a rank prints its text and its newline in two writes
(unbuffered Python does), another rank's write can land between them, and one
line of mpirun's output reads ``[1,1]<stdout>:text of 1[1,0]<stdout>:text of 0``
followed later by ``[1,1]<stdout>:`` (rank 1's newline). So each tagged piece
is added to its own rank's unfinished line, and a line is complete when its
rank's newline arrives.
"""

from __future__ import annotations

import codecs
import collections
import os
import re
import sys
import threading
from pathlib import Path
from typing import IO

# A rank's tag: [rank]<stream>: (Gloo) or [jobid,rank]<stream>: (Open MPI).
TAG = re.compile(rb"\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:")
TAIL_LINES = 20
MAX_PIECE = 64 * 1024  # characters of one line printed at once; longer lines come in pieces
READ_SIZE = 64 * 1024
_BREAKS = re.compile(r"(\r\n|\r|\n)")
_LONGEST_TAG = 32  # characters kept back at a cut so that a tag is never split

LAUNCHER = -1  # the "rank" of the launcher's own lines


def decoder():
    """An incremental UTF-8 decoder that replaces bad bytes instead of raising."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


class _Line:
    """One rank stream's unfinished line: its text so far and what the console shows."""

    __slots__ = ("text", "shown", "returned", "logged")

    def __init__(self):
        self.text = ""  # since the last carriage return
        self.shown = ""  # the last update printed in place ("" if none)
        self.returned = False  # a carriage return came: the next text starts the line anew
        self.logged = 0  # characters of a long line already printed as pieces


class RankOutput:
    """Routes rank output to the console, log files and tail buffers (thread-safe).

    Example: ``out.feed("[1,0]<stdout>:loss 0.5\\n", "stdout")`` prints
    ``[rank 0] loss 0.5`` and appends ``loss 0.5`` to ``<log_dir>/rank.0/stdout``.
    """

    def __init__(self, log_dir: str | Path | None = None, prefix: bool = True):
        self.log_dir = Path(log_dir) if log_dir else None
        self.prefix = prefix
        self.tails: dict[int, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES)
        )
        self.launcher_lines: collections.deque = collections.deque(maxlen=200)
        self._files: dict[tuple[int, str], IO[str]] = {}
        self._lines: dict[tuple[int, str], _Line] = {}  # (rank, stream) -> its unfinished line
        self._raw: dict[str, bytes] = {}  # a launcher pipe's bytes not yet routed
        self._decoders: dict[tuple[int, str], codecs.IncrementalDecoder] = {}
        self._owner: dict[str, tuple[int, str] | None] = {}  # who a pipe's untagged text is
        self._open: tuple[tuple[int, str], str] | None = None  # console line left open, its text
        self._lock = threading.RLock()

    # --- the console and the files ------------------------------------------------------

    def _file(self, rank: int, stream: str) -> IO[str] | None:
        if self.log_dir is None or rank == LAUNCHER:
            return None
        key = (rank, stream)
        if key not in self._files:
            path = self.log_dir / f"rank.{rank}" / stream
            path.parent.mkdir(parents=True, exist_ok=True)
            self._files[key] = open(path, "a", buffering=1, encoding="utf-8", errors="replace")
        return self._files[key]

    def _console(self, key: tuple[int, str], text: str, *, end: bool) -> None:
        """Print ``text`` as ``key``'s line: in place of its open update, or on a new line."""
        rank, stream = key
        out = sys.stderr if stream == "stderr" else sys.stdout
        shown = f"[rank {rank}] {text}" if self.prefix and rank != LAUNCHER else text
        if self._open is not None and self._open[0] == key:
            if shown != self._open[1]:
                out.write("\r" + shown + " " * max(0, len(self._open[1]) - len(shown)))
        else:
            self._close_open_line()
            out.write(shown)
        if end:
            out.write("\n")
            self._open = None
        else:
            self._open = (key, shown)
        out.flush()

    def _close_open_line(self) -> None:
        if self._open is not None:
            out = sys.stderr if self._open[0][1] == "stderr" else sys.stdout
            out.write("\n")
            out.flush()
            self._open = None

    def rank_line(self, rank: int, stream: str, text: str) -> None:
        """A whole line of ``rank``'s ``stream``: console, log file and tail."""
        with self._lock:
            self._line_ended((rank, stream), text, piece=False)

    def _line_ended(self, key: tuple[int, str], text: str, *, piece: bool) -> None:
        rank, stream = key
        if rank == LAUNCHER:
            self.launcher_lines.append(text)
        else:
            self.tails[rank].append(text)
        f = self._file(rank, stream)
        if f is not None:
            f.write(text if piece else text + "\n")
        self._console(key, text, end=True)

    def launcher_line(self, text: str, stream: str = "stderr") -> None:
        with self._lock:
            self._line_ended((LAUNCHER, stream), text, piece=False)

    # --- the line machine -----------------------------------------------------------------

    def _route(self, key: tuple[int, str], text: str) -> None:
        """Add ``text`` (any mix of text, ``\\r`` and ``\\n``) to ``key``'s line."""
        line = self._lines.setdefault(key, _Line())
        for part in _BREAKS.split(text):
            if part in ("\n", "\r\n"):
                final = line.text if (line.text or not line.returned) else line.shown
                self._line_ended(key, final, piece=False)
                self._lines[key] = line = _Line()
            elif part == "\r":
                self._update(key, line)
                line.text, line.returned = "", True
            elif part:
                line.text += part.replace("\b", "")
                if line.returned:  # a line being updated in place: show each update at once
                    self._update(key, line)
                while len(line.text) > MAX_PIECE:  # a long line goes out in pieces
                    head, line.text = line.text[:MAX_PIECE], line.text[MAX_PIECE:]
                    self._line_ended(key, head, piece=True)

    def _update(self, key: tuple[int, str], line: _Line) -> None:
        if line.text and line.text != line.shown and len(line.text) <= MAX_PIECE:
            line.shown = line.text
            self._console(key, line.text, end=False)

    def feed(self, data: bytes | str, default_stream: str) -> None:
        """Output of a Horovod launcher's pipe (tagged by rank; see the module docstring).

        Example: ``feed(b"[1,1]<stdout>:b[1,0]<stdout>:a\\n", "stdout")`` prints
        rank 0's line ``a`` and keeps ``b`` until rank 1's newline arrives.
        ``data`` may end anywhere, even inside a tag or a character: the rest
        waits for the next call. Tags are found in the bytes and each rank's
        bytes are decoded apart, since mpirun may tag the middle of a character.
        """
        if isinstance(data, str):
            data = data.encode("utf-8", errors="surrogateescape")
        with self._lock:
            raw = self._raw.get(default_stream, b"") + data
            cut = max(raw.rfind(b"\n"), raw.rfind(b"\r")) + 1
            if len(raw) - cut > MAX_PIECE:  # no break for long: route all but a tag's length
                cut = len(raw) - _LONGEST_TAG
            self._raw[default_stream] = raw[cut:]
            self._route_tagged(raw[:cut], default_stream)

    def _route_tagged(self, data: bytes, default_stream: str) -> None:
        before, *tagged = TAG.split(data)  # before, rank, stream, text, rank, ...
        pieces = [(self._owner.get(default_stream), before)]
        for rank, stream, piece in zip(tagged[::3], tagged[1::3], tagged[2::3], strict=True):
            pieces.append(((int(rank), stream.decode()), piece))
        for owner, piece in pieces:
            # A piece belongs to its tag's rank up to its newline; untagged text after a
            # newline is the launcher's own (mpirun's and horovodrun's messages).
            while piece:
                key = owner if owner is not None else (LAUNCHER, default_stream)
                head, newline, piece = piece.partition(b"\n")
                self._route_bytes(key, head + newline)
                if newline:
                    owner = None
            self._owner[default_stream] = owner

    def _route_bytes(self, key: tuple[int, str], data: bytes, final: bool = False) -> None:
        utf8 = self._decoders.get(key)
        if utf8 is None:
            utf8 = self._decoders[key] = decoder()
        self._route(key, utf8.decode(data, final=final))

    def finish_lines(self, stream: str | None = None) -> None:
        """Print the unfinished lines (of ``stream``, or all): their output ended."""
        with self._lock:
            for pipe in [s for s in self._raw if stream is None or s == stream]:
                rest = self._raw.pop(pipe)
                if rest:
                    self._route_tagged(rest, pipe)
                self._owner.pop(pipe, None)
            for key in [k for k in self._decoders if stream is None or k[1] == stream]:
                self._route_bytes(key, b"", final=True)
                del self._decoders[key]
            for key in sorted(k for k in self._lines if stream is None or k[1] == stream):
                line = self._lines.pop(key)
                if line.text or line.shown:
                    self._line_ended(key, line.text or line.shown, piece=False)

    # --- reading pipes ------------------------------------------------------------------

    def pump(self, pipe: IO, default_stream: str, rank: int | None = None) -> threading.Thread:
        """Read ``pipe`` (bytes or text) to its end on a thread.

        With ``rank`` everything is that rank's (a worker's own program);
        without, the text is a Horovod launcher's, tagged with ranks.
        """
        route = (
            (lambda data: self.feed(data, default_stream))
            if rank is None
            else (lambda data: self._routed((rank, default_stream), data))
        )
        t = threading.Thread(target=self._drain, args=(pipe, route, default_stream), daemon=True)
        t.start()
        return t

    def _routed(self, key: tuple[int, str], data: bytes) -> None:
        with self._lock:
            self._route_bytes(key, data)

    def _drain(self, pipe: IO, route, stream: str) -> None:
        read = _reader(pipe)
        complained = False
        while True:
            try:
                data = read()
            except (OSError, ValueError):  # the pipe was closed under us
                data = b""
            if isinstance(data, str):  # a text stream (tests, notebooks)
                data = data.encode("utf-8", errors="surrogateescape")
            try:
                if data:
                    route(data)
                if not data:
                    self.finish_lines(stream)
            except Exception as exc:
                if not complained:
                    complained = True
                    self._report_relay_error(exc, stream)
            if not data:
                return

    def _report_relay_error(self, exc: Exception, stream: str) -> None:
        try:
            self.launcher_line(
                f"hvdkit: error relaying the ranks' {stream} ({type(exc).__name__}: {exc}); "
                "the relay goes on, but a line may be shown wrongly."
            )
        except Exception:
            pass

    # --- failure reports ----------------------------------------------------------------

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
            self._lines.clear()
            self._raw.clear()
            self._owner.clear()
            self._decoders.clear()
            self._close_open_line()

    def close(self) -> None:
        with self._lock:
            self.finish_lines()
            self._close_open_line()
            for f in self._files.values():
                f.close()
            self._files.clear()


def _reader(pipe: IO):
    """A function returning the pipe's next chunk: bytes as soon as any arrive, or text."""
    try:
        fd = pipe.fileno()
    except (AttributeError, OSError, ValueError):
        fd = None
    if fd is not None and "b" in getattr(pipe, "mode", "rb"):
        return lambda: os.read(fd, READ_SIZE)
    read = getattr(pipe, "read1", None) or pipe.read
    return lambda: read(READ_SIZE)


def tag_pipe(fd: int, dst: IO[str], tag: str) -> None:
    """Copy the bytes of ``fd`` to ``dst``, each line and line update after ``tag``.

    The relay :func:`hvdkit._compat.use_robust_output_relay` gives ``horovodrun
    --gloo`` in place of Horovod's own, which stops at the first byte that is
    not UTF-8 (and the rank then blocks on a full pipe). Text is decoded with
    replacement, a ``\\r`` or ``\\n`` ends a tagged piece, and a piece never
    exceeds :data:`MAX_PIECE` characters (:class:`RankOutput` joins the pieces
    of one line again).

    Example: the bytes ``b"a\\rb\\n"`` with tag ``[0]<stdout>:`` are written
    as ``[0]<stdout>:a\\r[0]<stdout>:b\\n``.
    """
    utf8 = decoder()
    pending = ""
    while True:
        try:
            data = os.read(fd, READ_SIZE)
        except OSError:
            data = b""
        pending += utf8.decode(data, final=not data)
        cut = max(pending.rfind("\n"), pending.rfind("\r")) + 1
        if not data:
            cut = len(pending)
        pieces = [p for p in _BREAKS.split(pending[:cut]) if p]
        pending = pending[cut:]
        while len(pending) > MAX_PIECE:
            pieces.append(pending[:MAX_PIECE])
            pending = pending[MAX_PIECE:]
        out = []
        for piece in pieces:
            if piece in ("\n", "\r", "\r\n") and out and not out[-1].endswith(("\n", "\r")):
                out[-1] += piece
            else:
                out.append(tag + piece)
        try:
            if out:
                _write_whole("".join(out), dst)
        except (OSError, ValueError):
            pass  # our reader is gone: keep draining so the rank never blocks
        if not data:
            return


# All tag_pipe threads of a process (one per rank and stream) write to the same
# console. Under PYTHONUNBUFFERED=1 that console has no buffer of its own, and
# the kernel interleaves two threads' writes larger than a pipe's atomic size
# (4 KiB), cutting a tagged line in two: hence one lock and whole writes.
_WRITE_LOCK = threading.Lock()


def _write_whole(text: str, dst: IO[str]) -> None:
    """Write ``text`` to ``dst`` in one piece with respect to the other relays."""
    with _WRITE_LOCK:
        try:
            fd = dst.fileno()
        except (AttributeError, OSError, ValueError):  # a stream of Python objects (notebooks)
            dst.write(text)
            dst.flush()
            return
        dst.flush()
        data = text.encode(getattr(dst, "encoding", None) or "utf-8", errors="replace")
        while data:  # os.write may write part of it (a signal, a full pipe)
            data = data[os.write(fd, data) :]
