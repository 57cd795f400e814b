"""A quick reading of the plain requests Horovod's store sends, before ``http.server``'s own.

``http.server`` reads a request's headers with the ``email`` package
(``http.client.parse_headers``): about a third of the rendezvous server's CPU for a
request of a few bytes (py-spy, benchmarks/rendezvous.py), and a world of 1,000
ranks sends 19,000 requests. Horovod's HTTP store sends plain ones: ``GET``,
``PUT`` or ``DELETE`` of ``/scope/key`` in HTTP/1.0 or 1.1 and a few ``Name:
value`` header lines. :func:`read_plain_request` reads those itself; anything else
(another method, a folded or odd header line, too many or too long lines, the end
of the stream before the blank line) is given to ``http.server``'s parser as it
came, with the lines already read replayed first (:class:`Replay`), so its answers
and limits hold for everything that is not plain.

Example::

    >>> import io
    >>> class Handler:
    ...     protocol_version = "HTTP/1.0"
    ...     raw_requestline = b"PUT /global/0 HTTP/1.1\\r\\n"
    ...     rfile = io.BytesIO(b"Host: a\\r\\nContent-Length:  3\\r\\n\\r\\nabc")
    >>> h = Handler()
    >>> read_plain_request(h), h.command, h.path, h.headers["content-length"], h.rfile.read()
    (True, 'PUT', '/global/0', '3', b'abc')
    >>> h.rfile = io.BytesIO(b" folded\\r\\n\\r\\n")  # not plain: read again by http.server
    >>> read_plain_request(h), h.rfile.readline()
    (False, b' folded\\r\\n')
"""

from __future__ import annotations

import http.client
import re

# "<method> <path> HTTP/1.<0 or 1>": one space apart, a path of /scope/key, no controls
_REQUEST_LINE = re.compile(rb"(GET|PUT|DELETE) (/[^/\s\x00-\x1f\x7f]\S*) (HTTP/1\.[01])\r?\n\Z")
# "Name: value": a token, a colon, the value to the end of the line (no controls but tab)
_HEADER_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):([^\x00-\x08\x0a-\x1f\x7f]*)\r?\n\Z")
MAX_LINES = 32  # header lines of a plain request; more go to http.server (its own limits)
MAX_LINE = 1024  # bytes of one; a longer line goes to http.server likewise


class Replay:
    """A request's reader that gives back ``lines`` (read already) before reading on."""

    def __init__(self, lines: list[bytes], rfile):
        self._lines, self._rfile = lines, rfile

    def readline(self, limit: int = -1) -> bytes:
        if not self._lines:
            return self._rfile.readline(limit)
        line = self._lines.pop(0)
        if not line.endswith(b"\n") and line and (limit < 0 or len(line) < limit):
            # a line cut at MAX_LINE: the rest of it, as one readline would have given it
            line += self._rfile.readline(limit - len(line) if limit >= 0 else -1)
        return line

    def __getattr__(self, name):
        return getattr(self._rfile, name)


def read_plain_request(handler) -> bool:
    """Read ``handler``'s request line and headers if the request is plain; whether it was.

    When it was: ``command``, ``path``, ``request_version``, ``requestline`` and
    ``headers`` (an ``http.client.HTTPMessage``) are set as ``http.server`` sets
    them, and ``rfile`` is at the body. When it was not: ``rfile`` gives back what
    was read first, for ``BaseHTTPRequestHandler.parse_request`` to read it all.
    Only for a server that answers in HTTP/1.0 (Horovod's), where neither
    ``Connection`` nor ``Expect`` changes what ``http.server`` does.
    """
    line = _REQUEST_LINE.match(handler.raw_requestline)
    if line is None or handler.protocol_version >= "HTTP/1.1":
        return False
    lines: list[bytes] = []
    while True:
        read = handler.rfile.readline(MAX_LINE + 1)
        lines.append(read)
        if read in (b"\r\n", b"\n"):
            break
        if len(lines) > MAX_LINES or _HEADER_LINE.match(read) is None:
            handler.rfile = Replay(lines, handler.rfile)
            return False
    headers = http.client.HTTPMessage()
    for read in lines[:-1]:
        name, value = _HEADER_LINE.match(read).groups()
        headers[name.decode("latin-1")] = value.decode("latin-1").lstrip(" \t")
    handler.command, path, handler.request_version = (w.decode("latin-1") for w in line.groups())
    handler.path = path
    handler.requestline = handler.raw_requestline.decode("latin-1").rstrip("\r\n")
    handler.headers = headers
    handler.close_connection = True
    return True
